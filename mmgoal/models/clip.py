"""CLIP-family dual encoders (Radford et al., ICML 2021; SigLIP, Zhai et al., ICCV 2023):
open_clip models and Hugging Face CLIP/SigLIP, each used exactly as its library builds it,
with its library's transforms and tokenizer as its own preprocessing (docs/models.md,
"CLIP-family models"). The transforms are registered in ``TRANSFORMS``, so the pipeline
builds them by name; open_clip and transformers are imported only when something of theirs
is built, so ``import mmgoal`` does not load them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from mmgoal.config import PositiveInt, close_match_hints, first_line
from mmgoal.files import read_text
from mmgoal.models.efficiency import enable_grad_checkpointing
from mmgoal.models.locking import check_unlocked, freezing_only, hf_tower_groups, lock_groups
from mmgoal.models.lora import LoRATargets, PeftSection
from mmgoal.models.pretrained import check_weights_fit, load_hf_model, weights_file_shapes
from mmgoal.paths import (
    OPEN_CLIP_CONFIG,
    from_pretrained,
    hub_file,
    offline,
    offline_hint,
    open_clip_source,
    resolve_path,
)
from mmgoal.registry import ADAPTERS, MODELS, TRANSFORMS
from mmgoal.scoring import DotProductScores
from mmgoal.structures import ImageFeatures, Preprocessing, TextFeatures

logger = logging.getLogger(__name__)


class _RandomInitFilter(logging.Filter):
    """Drops open_clip's "No pretrained weights loaded ... initialized randomly" (a root
    logger warning): a model built without ``pretrained`` is initialised randomly on
    purpose, or takes a checkpoint's weights right after (mmgoal eval, export), and the
    shape check's skeleton loads none by design."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("No pretrained weights loaded for model")


@contextlib.contextmanager
def _no_random_init_warning(quiet: bool = True) -> Iterator[None]:
    """open_clip's "initialized randomly" warning dropped while ``quiet``."""
    if not quiet:
        yield
        return
    drop = _RandomInitFilter()
    logging.getLogger().addFilter(drop)
    try:
        yield
    finally:
        logging.getLogger().removeFilter(drop)

# open_clip's default weights file of a Hugging Face hub entry, and its safetensors twin
# (open_clip.pretrained.download_pretrained_from_hf looks for the twin first)
OPEN_CLIP_HUB_FILE = "open_clip_pytorch_model.bin"
OPEN_CLIP_HUB_SAFE_FILE = "open_clip_model.safetensors"
# A model folder or hub entry in open_clip's layout (OPEN_CLIP_CONFIG and the weights)
SCHEMES = ("hf-hub:", "local-dir:")
# what open_clip's push_to_hf_hub writes of the preprocessing into OPEN_CLIP_CONFIG
PREPROCESS_KEYS = ("mean", "std", "interpolation", "resize_mode")


# ------------------------------------------------------------------------------ open_clip
def open_clip_architecture_keys() -> list[str]:
    """The keys ``model_kwargs`` may set: the parameters of open_clip's model classes (CLIP,
    CustomTextCLIP, CoCa), less those of ``create_model`` itself, which decide how weights
    are found and read (``weights_only``, ``pretrained_image_path``, ``cache_dir``...)
    and are never a config's to set, and the dtype (``train.precision``'s)."""
    import inspect

    import open_clip

    loading = set(inspect.signature(open_clip.create_model).parameters)
    keys = {name for cls in (open_clip.CLIP, open_clip.CustomTextCLIP, open_clip.CoCa)
            for name in inspect.signature(cls.__init__).parameters}
    return sorted(keys - loading - {"self", "cast_dtype"})


def check_model_kwargs(model_name: str, model_kwargs: dict | None) -> None:
    """Refuse a ``model_kwargs`` key that is not an architecture key (see
    :func:`open_clip_architecture_keys`): ``create_model`` would take it as a loading
    switch (``weights_only: false`` would unpickle a received ``pretrained`` file)."""
    allowed = open_clip_architecture_keys()
    unknown = sorted(set(model_kwargs or {}) - set(allowed))
    if unknown:
        raise ValueError(f"OpenCLIP {model_name} model_kwargs: "
                         f"{close_match_hints(unknown, allowed)} is not an architecture key "
                         f"(model_kwargs takes "
                         f"{', '.join(allowed)}); how weights are read is not a config's to "
                         f"say: mmgoal reads every weights file weights-only")


def open_clip_architecture(model_name: str, model_kwargs: dict | None = None) -> dict:
    """open_clip's architecture config of ``model_name`` (``embed_dim``, ``vision_cfg``,
    ``text_cfg``...) with ``model_kwargs`` (:func:`check_model_kwargs`) on top, as
    ``open_clip.create_model`` merges them (each key replaced whole)."""
    import open_clip

    check_model_kwargs(model_name, model_kwargs)
    if model_name.startswith(SCHEMES):
        return {**open_clip_folder_config(model_name)["model_cfg"], **(model_kwargs or {})}
    architecture = open_clip.get_model_config(model_name)
    if architecture is None:
        import difflib

        close = difflib.get_close_matches(model_name, open_clip.list_models(), n=5, cutoff=0.5)
        raise ValueError(f"open_clip has no architecture {model_name!r}; close names: "
                         f"{', '.join(close) or 'none'} (all: open_clip.list_models(); one of "
                         f"your own: open_clip.add_model_config(JSON) in a custom_imports module)")
    return {**architecture, **(model_kwargs or {})}


def open_clip_folder_config(model_name: str) -> dict:
    """The ``open_clip_config.json`` of a ``local-dir:FOLDER`` or ``hf-hub:ORG/NAME`` model
    (``model_cfg``, ``preprocess_cfg``): read from the folder, or fetched from the hub into
    its cache unless offline."""
    scheme, _, location = model_name.partition(":")
    if scheme == "local-dir":
        path = Path(resolve_path(location)) / OPEN_CLIP_CONFIG
        if not path.is_file():
            raise FileNotFoundError(f"OpenCLIP {model_name}: {path} does not exist; a local-dir "
                                    f"model is a folder with {OPEN_CLIP_CONFIG} and its weights "
                                    f"(mmgoal export --format open_clip writes one)")
    else:
        path = Path(hub_file(location, OPEN_CLIP_CONFIG, f"OpenCLIP {model_name}"))
    try:
        config = json.loads(read_text(path, "open_clip model config"))
    except ValueError as error:
        raise ValueError(f"OpenCLIP {model_name}: {path} is not JSON ({error})") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_cfg"), dict):
        raise ValueError(f"OpenCLIP {model_name}: {path} holds no model_cfg, so it is not an "
                         f"open_clip model folder")
    return config


def open_clip_preprocess(model_name: str, tag: str | None) -> dict:
    """open_clip's preprocessing settings (mean, std, interpolation, resize mode) of a
    pretrained tag, or of a folder or hub model's ``preprocess_cfg``; ``{}``: its defaults."""
    if model_name.startswith(SCHEMES):
        return dict(open_clip_folder_config(model_name).get("preprocess_cfg") or {})
    return open_clip_tag(model_name, tag)


def open_clip_tag(model_name: str, pretrained: str | None) -> dict:
    """open_clip's config of the pretrained tag ``pretrained`` of ``model_name``; ``{}`` when
    it is not a tag (a file, or ``None``)."""
    from open_clip.pretrained import get_pretrained_cfg

    return get_pretrained_cfg(model_name, pretrained) if pretrained else {}


def cached_tag_file(model_name: str, tag: str, tag_cfg: dict) -> str:
    """The local file of a pretrained tag, found where open_clip would have downloaded it
    (the Hugging Face cache, or ``~/.cache/clip`` for a URL): what offline uses. Missing,
    a ``FileNotFoundError`` gives the command that fetches it."""
    from huggingface_hub import try_to_load_from_cache

    if tag_cfg.get("file"):
        return tag_cfg["file"]
    looked, fetch = [], f"download {tag_cfg.get('url')}"
    if tag_cfg.get("hf_hub"):
        repo_id, filename = os.path.split(tag_cfg["hf_hub"])
        filename = filename or OPEN_CLIP_HUB_FILE
        fetch = f"hf download {repo_id} {filename}"
        names = [OPEN_CLIP_HUB_SAFE_FILE] if filename == OPEN_CLIP_HUB_FILE else \
            [filename[:-4] + ".safetensors"] if filename.endswith((".bin", ".pth")) else []
        for name in [*names, filename]:
            found = try_to_load_from_cache(repo_id, name)
            if isinstance(found, str):
                return found
            looked.append(f"{repo_id}/{name} in the Hugging Face cache")
    if tag_cfg.get("url"):
        path = Path("~/.cache/clip").expanduser() / os.path.basename(tag_cfg["url"])
        if path.is_file():
            return str(path)
        looked.append(str(path))
    raise FileNotFoundError(
        f"OpenCLIP {model_name} pretrained tag {tag!r}: its weights are not on this machine "
        f"(looked for {'; '.join(looked)}) and {offline_hint()} (on a machine with network: "
        f"{fetch}; then set model.pretrained to the file's path, or copy the cache)")


def downloaded_tag_file(model_name: str, tag: str, tag_cfg: dict) -> str:
    """The weights of a pretrained tag, fetched as open_clip fetches them (the Hugging Face
    hub, its safetensors twin first, or the tag's URL) into the usual caches."""
    from open_clip.pretrained import download_pretrained

    try:
        path = download_pretrained(tag_cfg)
    except Exception as error:  # open_clip's, huggingface_hub's and urllib's errors
        reason = first_line(error)
        raise FileNotFoundError(f"OpenCLIP {model_name} pretrained tag {tag!r}: its weights "
                                f"could not be downloaded ({reason}); check the network "
                                f"(HF_ENDPOINT, a proxy), or download the file elsewhere and "
                                f"set model.pretrained to its path") from error
    if not path:
        raise FileNotFoundError(f"OpenCLIP {model_name} pretrained tag {tag!r} names no file, "
                                f"hub entry or URL to fetch")
    return path


def open_clip_weights(model_name: str, pretrained: str) -> str:
    """The weights file ``pretrained`` names: a path (``pkg://`` too), or a pretrained tag's
    file, fetched from the hub unless offline (then it must be in the cache)."""
    tag_cfg = open_clip_tag(model_name, pretrained)
    if tag_cfg:
        if offline():
            return cached_tag_file(model_name, pretrained, tag_cfg)
        return downloaded_tag_file(model_name, pretrained, tag_cfg)
    path = resolve_path(pretrained)
    if Path(path).is_file():
        return path
    from open_clip import list_pretrained_tags_by_model

    tags = list_pretrained_tags_by_model(model_name)
    raise FileNotFoundError(f"OpenCLIP {model_name} pretrained {pretrained!r} is neither a file "
                            f"nor one of its tags ({', '.join(tags) or 'none'})")


def check_open_clip_fits(model_name: str, weights: str | None,
                         model_kwargs: dict | None) -> None:
    """Refuse weights (the ``pretrained`` file, or a ``local-dir:``/cached ``hf-hub:``
    folder's, whose config may claim any size) that the architecture, built on the meta
    device, does not describe, before open_clip allocates it
    (:func:`mmgoal.models.pretrained.check_weights_fit`)."""
    import open_clip

    source = open_clip_source(model_name)
    if weights is None and source.startswith("local-dir:"):
        # the file create_model picks from the folder (its order of preferred names)
        from open_clip.factory import _find_checkpoint_in_dir

        weights = _find_checkpoint_in_dir(Path(source.removeprefix("local-dir:")))
    shapes = None if weights is None else weights_file_shapes(weights)
    if shapes is None:
        return
    try:
        with torch.device("meta"), _no_random_init_warning():
            skeleton = open_clip.create_model(source, load_weights=False, device="meta",
                                              pretrained_text=False, weights_only=True,
                                              **(model_kwargs or {}))
    except Exception as error:  # a bad architecture: the real create_model then says what
        logger.debug("OpenCLIP %s cannot be built on the meta device (%s)", model_name, error)
        return
    config = (f"its {OPEN_CLIP_CONFIG}" if model_name.startswith(SCHEMES) else
              f"architecture {model_name}{' with its model_kwargs' if model_kwargs else ''}")
    check_weights_fit(skeleton, shapes, f"OpenCLIP {model_name}: {config}", weights)


@TRANSFORMS.register(name="OpenCLIPTransform")
def open_clip_transform(model_name: str, tag: str | None = None,
                        image_size: PositiveInt | None = None, training: bool = False) -> Callable:
    """open_clip's own image preprocessing of a model, as ``create_model_and_transforms``
    builds it: pretrained ``tag``'s statistics and resize mode, else open_clip's defaults;
    ``training``: its random resized crop."""
    from open_clip.transform import PreprocessCfg, image_transform_v2, merge_preprocess_dict

    size = image_size or open_clip_architecture(model_name)["vision_cfg"]["image_size"]
    cfg = merge_preprocess_dict(PreprocessCfg(), open_clip_preprocess(model_name, tag))
    return image_transform_v2(PreprocessCfg(**{**cfg, "size": size}), is_train=training)


def check_image_size(image_size: int | None, own: int, model: str) -> None:
    """A ``ValueError`` when ``data.image_size`` asks for another size than the model reads."""
    if image_size is not None and image_size != own:
        raise ValueError(f"data.image_size {image_size} differs from the {own} pixels {model} "
                         f"is built for; set data.image_size to null (the model's own size), "
                         f"or change the model")


class CLIPLogits(DotProductScores):
    """What OpenCLIP and HFCLIP share: the pair scores of the library model they wrap
    (``self.model``) are cosines, scaled by its learnt ``logit_scale`` (InfoNCE's
    temperature, :class:`mmgoal.contract.TemperatureModel`) and shifted by SigLIP's
    ``logit_bias`` where it has one."""

    def temperature(self) -> torch.Tensor:
        """``1 / exp(logit_scale)``, a scalar that carries the gradient to ``logit_scale``."""
        return torch.exp(-self.model.logit_scale).reshape(())

    def logit_bias(self) -> torch.Tensor | None:
        """SigLIP's learnt ``logit_bias`` (a scalar), or None for a model without one."""
        bias = getattr(self.model, "logit_bias", None)
        return None if bias is None else bias.reshape(())


@MODELS.register()
class OpenCLIP(CLIPLogits, nn.Module):
    """An open_clip model (CLIP, OpenCLIP, MobileCLIP, SigLIP...) as a dual encoder: its
    embeddings are exactly open_clip's normalised ``encode_image`` / ``encode_text``.

    Args:
        model_name: an open_clip architecture, or ``hf-hub:ORG/NAME`` / ``local-dir:FOLDER``
            (open_clip's folder layout, with its weights).
        pretrained: a local weights file (``pkg://`` too), a pretrained tag (fetched
            unless offline), or ``None``: random weights (or the folder's own).
        model_kwargs: architecture keys of ``create_model``, each replaced whole.
        peft: LoRA adapters trained in place of the weights (docs/models.md, "LoRA").
    """

    # model.peft's defaults: torch's MultiheadAttention of open_clip's blocks multiplies
    # its in_proj_weight itself (mmgoal/models/lora.py)
    LORA_TARGETS = LoRATargets(target_parameters=("attn.in_proj_weight",),
                               trainable=("logit_scale", "logit_bias"))

    def __init__(self, model_name: str, pretrained: str | None = None,
                 model_kwargs: dict | None = None, grad_checkpointing: bool = False,
                 peft: PeftSection = None) -> None:
        super().__init__()
        import open_clip

        architecture = open_clip_architecture(model_name, model_kwargs)
        if model_name.startswith(SCHEMES) and pretrained is not None:
            raise ValueError(f"OpenCLIP {model_name} brings its own weights; pretrained "
                             f"{pretrained!r} would be ignored: leave it out")
        weights = None if pretrained is None else open_clip_weights(model_name, pretrained)
        tag_cfg = open_clip_tag(model_name, pretrained)
        if tag_cfg and tag_cfg.get("quick_gelu", False) != architecture.get("quick_gelu", False):
            logger.warning("OpenCLIP %s: the %s weights were trained with quick_gelu=%s, the "
                           "architecture has %s; use the %s-quickgelu model_name (or the "
                           "plain one) to match", model_name, pretrained,
                           tag_cfg.get("quick_gelu", False), architecture.get("quick_gelu", False),
                           model_name.removesuffix("-quickgelu"))
        check_open_clip_fits(model_name, weights, model_kwargs)
        # no pretrained weights is a config's choice (or a checkpoint's weights come next):
        # open_clip's "initialized randomly" warning would say otherwise
        try:
            with _no_random_init_warning(weights is None):
                # weights_only by name: only architecture keys come from the config
                # on the default device: the meta device, where a received config is first
                # checked (mmgoal/runs/loading.py), allocates nothing
                self.model = open_clip.create_model(open_clip_source(model_name),
                                                    pretrained=weights, weights_only=True,
                                                    device=torch.get_default_device(),
                                                    **(model_kwargs or {}))
        except (TypeError, KeyError) as error:  # architecture keys of another model family
            raise ValueError(f"OpenCLIP {model_name} cannot be built with model_kwargs "
                             f"{sorted(model_kwargs or {})} ({type(error).__name__}: {error}); "
                             f"they may belong to another architecture: give the "
                             f"{model_name} keys, or remove model_kwargs") from error
        self.model_name = model_name
        self.architecture = architecture  # the model_cfg it was built with, model_kwargs in
        self.tag = pretrained if tag_cfg else None  # whose preprocessing the model reads
        if peft is not None:
            ADAPTERS.build(peft).apply(self.model, self.LORA_TARGETS, f"OpenCLIP {model_name}")
        if grad_checkpointing:
            enable_grad_checkpointing(self)

    # the formats mmgoal export --format writes for this family (besides mmgoal's own)
    EXPORT_FORMATS = ("open_clip",)

    @classmethod
    def export_folder_section(cls, folder: Path) -> dict:
        """The model section that reads back an ``open_clip`` export folder (open_clip's
        ``local-dir:`` layout: its config, weights and preprocessing)."""
        return {"type": "OpenCLIP", "model_name": f"local-dir:{folder}"}

    @classmethod
    def pretrained_weights(cls, cfg: dict) -> str | None:
        """What the config's section loads weights from (zero-shot evaluation asks): its
        ``pretrained`` file or tag, or its ``hf-hub:``/``local-dir:`` model; None: random."""
        if str(cfg.get("model_name", "")).startswith(SCHEMES):
            return cfg["model_name"]
        return cfg.get("pretrained")

    def export_to(self, fmt: str, folder: Path, tokenizer: Any, transform: Any) -> list[str]:
        """Write the model in open_clip's folder layout (``fmt`` ``open_clip``), as
        ``push_to_hf_hub`` does: ``open_clip_config.json`` and
        ``open_clip_model.safetensors``, which ``create_model_and_transforms("local-dir:
        FOLDER")`` loads (a Hugging Face tokenizer beside them). Returns the files written."""
        from open_clip.transform import PreprocessCfg, merge_preprocess_dict
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().float().contiguous() if v.is_floating_point() else v
                   for k, v in self.model.state_dict().items()},
                  str(folder / OPEN_CLIP_HUB_SAFE_FILE))
        # the preprocessing mmgoal trained and evaluated with (a tag's statistics: open_clip
        # did not see the tag, mmgoal handed it the tag's file)
        preprocess = merge_preprocess_dict(PreprocessCfg(),
                                           open_clip_preprocess(self.model_name, self.tag))
        (folder / OPEN_CLIP_CONFIG).write_text(json.dumps({
            "model_cfg": self.architecture,
            "preprocess_cfg": {key: preprocess[key] for key in PREPROCESS_KEYS}}, indent=2))
        written = [OPEN_CLIP_CONFIG, OPEN_CLIP_HUB_SAFE_FILE]
        inner = getattr(tokenizer, "tokenizer", None)
        if hasattr(inner, "save_pretrained"):  # SigLIP's, an HF text tower's; CLIP's BPE ships
            inner.save_pretrained(str(folder))
            written.append("the tokenizer's files")
        return written

    @classmethod
    def preprocessing(cls, cfg: dict, image_size: int | None) -> Preprocessing:
        """open_clip's train and eval transforms (with the preprocessing of a pretrained tag)
        and tokenizer of the model; ``data.image_size``, if set, must be its size."""
        architecture = open_clip_architecture(cfg["model_name"], cfg.get("model_kwargs"))
        own_size = architecture["vision_cfg"]["image_size"]
        check_image_size(image_size, own_size, f"OpenCLIP {cfg['model_name']}")
        transform = {"type": "OpenCLIPTransform", "model_name": cfg["model_name"],
                     "image_size": own_size}
        if open_clip_tag(cfg["model_name"], cfg.get("pretrained")):
            transform["tag"] = cfg["pretrained"]
        tokenizer = {"type": "OpenCLIPTokenizer", "model_name": cfg["model_name"]}
        context_length = architecture["text_cfg"].get("context_length")
        if context_length is not None:
            tokenizer["context_length"] = context_length
        return Preprocessing(train_transforms=[{**transform, "training": True}],
                             eval_transforms=[transform], tokenizer=tokenizer)

    def lock_image_tower(self, unlocked: int = 0) -> None:
        """open_clip's own ``lock_image_tower(unlocked_groups)``, freezing only."""
        self._lock("image", self.model.visual, unlocked,
                   lambda: self.model.lock_image_tower(unlocked_groups=unlocked))

    def lock_text_tower(self, unlocked: int = 0) -> None:
        """open_clip's own ``lock_text_tower(unlocked_layers)``, freezing only."""
        self._lock("text", getattr(self.model, "text", self.model), unlocked,
                   lambda: self.model.lock_text_tower(unlocked_layers=unlocked))

    def _lock(self, side: str, tower: nn.Module, unlocked: int, lock: Callable[[], None]
              ) -> None:
        where = f"OpenCLIP {self.model_name}'s {side} tower"
        blocks = getattr(getattr(tower, "transformer", None), "resblocks", None)
        if unlocked and blocks is not None:  # open_clip's groups: stem, blocks, projection
            check_unlocked(len(blocks) + 2, unlocked, where)
        try:
            freezing_only(self, lock)
        except AssertionError as error:  # open_clip's refusals: a ResNet's partial lock
            raise ValueError(f"{where}: open_clip says {str(error) or 'no'}; lock it whole "
                             f"(no unlocked groups)") from error

    def encode_image(self, batch: dict) -> ImageFeatures:
        """``batch["images"]`` (B, 3, H, W) -> (B, embed_dim) unit vectors."""
        return ImageFeatures(self.model.encode_image(batch["images"], normalize=True))

    def encode_text(self, batch: dict) -> TextFeatures:
        """``batch["tokens"]`` (B, context_length) -> (B, embed_dim) unit vectors."""
        return TextFeatures(self.model.encode_text(batch["tokens"], normalize=True))


# ------------------------------------------------------------------------- Hugging Face
# The text padding each supported family was trained with: CLIP pools its end-of-text
# token wherever it is; SigLIP pools the last position, so its captions are padded to
# the full length (transformers' SigLIP docs: padding="max_length").
HF_TEXT_PADDING = {"clip": "longest", "siglip": "max_length"}


def hf_model_type(config) -> str:
    """The model type of a transformers config, refused unless ``HFCLIP`` supports it."""
    if config.model_type not in HF_TEXT_PADDING:
        raise ValueError(f"HFCLIP supports {', '.join(sorted(HF_TEXT_PADDING))} models, got a "
                         f"{config.model_type!r} model")
    return config.model_type


@TRANSFORMS.register()
class HFImageProcessor:
    """A Hugging Face image processor (``AutoImageProcessor``) of ``path`` as a transform: a
    PIL image -> the ``pixel_values`` the model reads (3, H, W)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoImageProcessor

        self.path = path
        self.processor = from_pretrained(AutoImageProcessor, path, "HFImageProcessor path")

    def __call__(self, image: Image.Image) -> torch.Tensor:
        return self.processor(images=image, return_tensors="pt")["pixel_values"][0]

    def __repr__(self) -> str:
        return f"HFImageProcessor(path={self.path!r}, {type(self.processor).__name__})"


def pooled_features(output) -> torch.Tensor:
    """The projected features of ``get_image_features`` / ``get_text_features``: a tensor
    before transformers 5, a model output holding them as ``pooler_output`` since."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output


@MODELS.register()
class HFCLIP(CLIPLogits, nn.Module):
    """A transformers ``CLIPModel`` or ``SiglipModel`` as a dual encoder (normalised
    ``get_image_features`` / ``get_text_features``, the folder's processor and tokenizer).

    Args:
        path: a ``save_pretrained`` folder of model and processor (``pkg://`` too), or a
            hub name; or ``config``: a random model's (``{model_type: clip, ...}``).
        peft: LoRA adapters trained in place of the weights (docs/models.md, "LoRA").
    """

    # model.peft's defaults: the encoder layers' attention projections, named by their
    # self_attn (SigLIP's pooling head is a torch MultiheadAttention: mmgoal/models/lora.py)
    LORA_TARGETS = LoRATargets(
        target_modules=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                        "self_attn.out_proj"),
        trainable=("logit_scale", "logit_bias"))

    def __init__(self, path: str | None = None, config: dict | None = None,
                 grad_checkpointing: bool = False, peft: PeftSection = None) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModel

        if (path is None) == (config is None):
            raise ValueError("HFCLIP needs exactly one of path or config")
        if path is not None:
            self.model = load_hf_model(path, "HFCLIP path")
        else:
            config = dict(config)
            model_type = config.pop("model_type", None)
            if model_type is None:
                raise ValueError("HFCLIP config needs a model_type (clip or siglip)")
            self.model = AutoModel.from_config(AutoConfig.for_model(model_type, **config))
        hf_model_type(self.model.config)
        if peft is not None:
            ADAPTERS.build(peft).apply(self.model, self.LORA_TARGETS,
                                       f"HFCLIP {path or self.model.config.model_type}")
        if grad_checkpointing:
            enable_grad_checkpointing(self)

    # the formats mmgoal export --format writes for this family (besides mmgoal's own)
    EXPORT_FORMATS = ("hf",)

    @classmethod
    def export_folder_section(cls, folder: Path) -> dict:
        """The model section that reads back an ``hf`` export folder (``save_pretrained``
        of the model, its image processor and tokenizer)."""
        return {"type": "HFCLIP", "path": str(folder)}

    @classmethod
    def pretrained_weights(cls, cfg: dict) -> str | None:
        """What the config's section loads weights from: its ``path``; None: a ``config``."""
        return cfg.get("path")

    def export_to(self, fmt: str, folder: Path, tokenizer: Any, transform: Any) -> list[str]:
        """Write a ``save_pretrained`` folder (``fmt`` ``hf``) of the model, the run's image
        processor and tokenizer, for ``AutoModel.from_pretrained``. Returns the files written.

        Raises:
            ValueError: the run's tokenizer or image transform is not a Hugging Face one.
        """
        processor = next((step for step in getattr(transform, "transforms", [transform])
                          if isinstance(step, HFImageProcessor)), None)
        hf_tokenizer = getattr(tokenizer, "tokenizer", None)
        if processor is None or not hasattr(hf_tokenizer, "save_pretrained"):
            raise ValueError("a Hugging Face folder needs the run's image processor and "
                             "tokenizer to be Hugging Face ones (HFCLIP's own from its path, "
                             "or HFImageProcessor and HFTokenizer in data); this run's are "
                             f"{type(transform).__name__} and {type(tokenizer).__name__}")
        folder.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(str(folder))
        processor.processor.save_pretrained(str(folder))
        hf_tokenizer.save_pretrained(str(folder))
        return sorted(p.name for p in folder.iterdir())

    @classmethod
    def preprocessing(cls, cfg: dict, image_size: int | None) -> Preprocessing:
        """The folder's image processor and tokenizer (none for a ``config`` model);
        ``data.image_size``, if set, must be the model's size."""
        if cfg.get("path") is None:
            return Preprocessing()
        from transformers import AutoConfig

        config = from_pretrained(AutoConfig, cfg["path"], "HFCLIP path")
        model_type = hf_model_type(config)
        check_image_size(image_size, config.vision_config.image_size,
                         f"HFCLIP {cfg['path']}")
        transforms = [{"type": "HFImageProcessor", "path": cfg["path"]}]
        return Preprocessing(
            train_transforms=transforms, eval_transforms=transforms,
            tokenizer={"type": "HFTokenizer", "path": cfg["path"],
                       "max_length": config.text_config.max_position_embeddings,
                       "padding": HF_TEXT_PADDING[model_type]})

    def lock_image_tower(self, unlocked: int = 0) -> None:
        lock_groups(hf_tower_groups(self.model.vision_model,
                                    getattr(self.model, "visual_projection", None)),
                    unlocked, "HFCLIP's image tower")

    def lock_text_tower(self, unlocked: int = 0) -> None:
        lock_groups(hf_tower_groups(self.model.text_model,
                                    getattr(self.model, "text_projection", None)),
                    unlocked, "HFCLIP's text tower")

    def encode_image(self, batch: dict) -> ImageFeatures:
        """``batch["images"]`` (B, 3, H, W) -> (B, projection_dim) unit vectors."""
        features = pooled_features(self.model.get_image_features(pixel_values=batch["images"]))
        return ImageFeatures(F.normalize(features, dim=-1))

    def encode_text(self, batch: dict) -> TextFeatures:
        """``batch["tokens"]``, ``batch["attention_mask"]`` (B, L) -> (B, projection_dim)."""
        features = pooled_features(self.model.get_text_features(
            input_ids=batch["tokens"], attention_mask=batch["attention_mask"].long()))
        return TextFeatures(F.normalize(features, dim=-1))
