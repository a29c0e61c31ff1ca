"""X-VLM-style cross encoder: a timm vision transformer, a Hugging Face BERT whose last
``fusion_layers`` layers become :class:`~mmgoal.models.layers.fusion.FusionLayer`
(initialised from the same pretrained layers), ITC projections and an ITM head
(docs/reference/xvlm.md).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from mmgoal.config import PositiveInt
from mmgoal.models.efficiency import enable_grad_checkpointing
from mmgoal.models.encoders.hf_text import HFTextEncoder
from mmgoal.models.encoders.timm_image import create_timm_backbone
from mmgoal.models.layers.fusion import FusionEncoder
from mmgoal.models.pretrained import tower_weights
from mmgoal.registry import MODELS
from mmgoal.scoring import DotProductScores
from mmgoal.sequences import length_mask
from mmgoal.structures import ImageFeatures, TextFeatures


@MODELS.register()
class XVLM(DotProductScores, nn.Module):
    """ViT + BERT with fusion layers; ``similarity`` is ITC, ``match_logits`` is ITM.

    Args:
        vision: ``create_timm_backbone``'s arguments: a timm ViT with a CLS token (a Swin
            gets the mean of its tokens as the CLS token).
        text: the text tower, as ``HFTextEncoder`` takes it (``model_path`` or ``config``).
        fusion_layers: how many of the BERT's last layers fuse the image (6 in X-VLM).
        mlm_head: an MLM head on the fusion states, ``tied`` to the word embeddings (as
            BERT) or ``separate``; None: no head.
        box_head: a box regressor on the fusion CLS state (``BoxGroundingLoss``).
    """

    @classmethod
    def pretrained_weights(cls, cfg: dict) -> str | None:
        """The towers' weights files and hub names (zero-shot evaluation asks)."""
        return tower_weights(cfg.get("vision"), cfg.get("text"))

    def __init__(self, vision: dict, text: dict, fusion_layers: PositiveInt = 6,
                 embed_dim: PositiveInt = 256,
                 mlm_head: Literal["tied", "separate"] | None = None, box_head: bool = False,
                 grad_checkpointing: bool = False, tokenizer=None) -> None:
        super().__init__()
        vision = dict(vision)
        if "model_name" not in vision:
            raise ValueError("XVLM vision needs a model_name (a timm vision transformer)")
        self.vision = create_timm_backbone(vision.pop("model_name"), **vision)
        self.vision_has_cls = getattr(self.vision, "cls_token", None) is not None
        if not self.vision_has_cls and getattr(self.vision, "output_fmt", None) != "NHWC":
            raise ValueError(f"XVLM needs a vision transformer (a ViT with a CLS token, or a "
                             f"Swin); {type(self.vision).__name__} is neither")
        text_tower = HFTextEncoder(**text, tokenizer=tokenizer)
        self.text = text_tower.model
        layers = getattr(getattr(self.text, "encoder", None), "layer", None)
        if layers is None:
            raise ValueError(f"XVLM needs a BERT-style text model (encoder.layer); got "
                             f"{type(self.text).__name__}")
        if not 0 < fusion_layers < len(layers):
            raise ValueError(f"fusion_layers must be between 1 and {len(layers) - 1} for a "
                             f"{len(layers)}-layer text model, got {fusion_layers}")
        keep = len(layers) - fusion_layers
        self.fusion = FusionEncoder(self.text.config, fusion_layers, init_from=list(layers[keep:]))
        self.text.encoder.layer = nn.ModuleList(layers[:keep])
        self.text.config.num_hidden_layers = keep
        if getattr(self.text, "pooler", None) is not None:
            self.text.pooler = None  # unused: ITC takes the CLS state
        hidden = self.text.config.hidden_size
        vision_width = self.vision.num_features
        self.image_to_text = (nn.Linear(vision_width, hidden) if vision_width != hidden
                              else nn.Identity())
        self.vision_proj = nn.Linear(vision_width, embed_dim)
        self.text_proj = nn.Linear(hidden, embed_dim)
        self.itm_head = nn.Linear(hidden, 2)
        self.embed_dim = embed_dim
        if mlm_head is not None:
            embeddings = self.text.get_input_embeddings()
            # BERT's prediction head: transform (dense, GELU, LayerNorm), then the decoder.
            self.mlm_transform = nn.Sequential(
                nn.Linear(hidden, hidden), nn.GELU(),
                nn.LayerNorm(hidden, eps=self.text.config.layer_norm_eps))
            self.mlm_decoder = nn.Linear(hidden, embeddings.num_embeddings)
            if mlm_head == "tied":
                self.mlm_decoder.weight = embeddings.weight
        if box_head:
            self.box_head = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(),
                                          nn.Linear(hidden, 4))
        if grad_checkpointing:
            enable_grad_checkpointing(self)

    def encode_image(self, batch: dict) -> ImageFeatures:
        """images (B, 3, H, W) -> ITC embedding of the CLS token and every image token."""
        tokens = self.vision.forward_features(batch["images"])  # (B, 1 + patches, width)
        if tokens.dim() == 4:  # Swin: (B, H, W, C) and no CLS; X-VLM uses the mean token
            tokens = tokens.flatten(1, 2)
        if not self.vision_has_cls:
            tokens = torch.cat([tokens.mean(1, keepdim=True), tokens], dim=1)
        mask = torch.ones(tokens.shape[:2], dtype=torch.bool, device=tokens.device)
        return ImageFeatures(F.normalize(self.vision_proj(tokens[:, 0]), dim=-1),
                             tokens=tokens, mask=mask)

    def encode_text(self, batch: dict) -> TextFeatures:
        """tokens (B, L), lengths (B,) -> ITC embedding of the CLS state and the text states."""
        tokens, lengths = batch["tokens"], batch["lengths"]
        mask = length_mask(lengths, tokens.shape[1])
        states = self.text(input_ids=tokens, attention_mask=mask.long()).last_hidden_state
        return TextFeatures(F.normalize(self.text_proj(states[:, 0]), dim=-1), tokens=states,
                            mask=mask)

    def fuse(self, image_features: ImageFeatures, text_features: TextFeatures) -> torch.Tensor:
        """Fusion states (B, L, hidden) of pairs: text ``b`` attends to image ``b``."""
        if len(image_features.tokens) != len(text_features.tokens):
            raise ValueError(f"fusion needs one image per text, got "
                             f"{len(image_features.tokens)} and {len(text_features.tokens)}")
        return self.fusion(text_features.tokens, text_features.mask,
                           self.image_to_text(image_features.tokens), image_features.mask)

    def match_logits(self, image_features: ImageFeatures,
                     text_features: TextFeatures) -> torch.Tensor:
        """ITM logits (B, 2) of pairs (image ``b``, text ``b``); column 1 is "match"."""
        return self.itm_head(self.fuse(image_features, text_features)[:, 0])

    def mlm_logits(self, image_features: ImageFeatures, text_batch: dict) -> torch.Tensor:
        """(B, L, vocab) word logits of the (masked) captions fused with their images."""
        if not hasattr(self, "mlm_decoder"):
            raise ValueError("this XVLM has no MLM head; set model.mlm_head: tied")
        states = self.fuse(image_features, self.encode_text(text_batch))
        return self.mlm_decoder(self.mlm_transform(states))

    def predict_boxes(self, image_features: ImageFeatures, text_batch: dict) -> torch.Tensor:
        """(B, 4) boxes (cx, cy, w, h as fractions of the image) of phrase ``b`` in image ``b``."""
        if not hasattr(self, "box_head"):
            raise ValueError("this XVLM has no box head; set model.box_head: true")
        states = self.fuse(image_features, self.encode_text(text_batch))
        return self.box_head(states[:, 0]).sigmoid()
