"""Checkpoints of another model or holding NaN/inf are refused with what to do, not a trace."""

import math

import pytest
import torch
from safetensors import safe_open

from mmgoal.data.tokenizers import WordTokenizer
from mmgoal.registry import MODELS
from mmgoal.runs.checkpoint import load_checkpoint, load_matching_weights, save_safetensors
from mmgoal.runs.loading import model_from_checkpoint

MODEL = {  # tests/engine/test_trainer.py's tiny DualEncoder, embed_dim 16
    "type": "DualEncoder", "embed_dim": 16,
    "image_encoder": {"type": "TimmImageEncoder", "model_name": "mmgoal_small_cnn",
                      "model_kwargs": {"widths": [8, 16]}},
    "text_encoder": {"type": "GRUTextEncoder", "word_dim": 8, "hidden_size": 16,
                     "bidirectional": True, "pooling": "mean"},
}
CONFIG = {"data": {"tokenizer": {"type": "WordTokenizer"}}, "model": MODEL}


def checkpoint_of(model_cfg: dict) -> dict:
    torch.manual_seed(0)
    tokenizer = WordTokenizer(vocab=["a", "red", "circle"])
    model = MODELS.build(model_cfg, tokenizer=tokenizer)
    return {"model": model.state_dict(), "tokenizer": tokenizer.state_dict(),
            "config": {"model": model_cfg}}


def test_a_checkpoint_of_the_config_s_model_loads():
    state = checkpoint_of(MODEL)
    model, tokenizer = model_from_checkpoint(CONFIG, state)
    assert not model.training and tokenizer.state_dict() == state["tokenizer"]
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, state["model"][name]), name


def test_a_checkpoint_of_another_size_says_where_the_models_differ():
    state = checkpoint_of({**MODEL, "embed_dim": 32})
    with pytest.raises(ValueError, match=r"^checkpoint big.pt does not fit the model this config "
                                         r"builds \(model.embed_dim: 32 in the checkpoint, 16 "
                                         r"here; shapes differ: \S+ \(32, \d+\) vs \(16, \d+\);.*"
                                         r"give the config it was trained with"):
        model_from_checkpoint(CONFIG, state, "checkpoint big.pt")
    state["config"] = {}  # an exported file without the config: the shapes alone
    with pytest.raises(ValueError, match=r"\(shapes differ: \S+ \(32, \d+\) vs \(16, \d+\); "):
        model_from_checkpoint(CONFIG, state, "checkpoint big.pt")


def test_weights_holding_inf_are_refused():
    state = checkpoint_of(MODEL)
    variances = [k for k in state["model"] if k.endswith("running_var")]
    for name in variances:
        state["model"][name].fill_(math.inf)
    message = (rf"holds NaN or inf in {len(variances)} tensors \({variances[0]}, .*\): its run "
               rf"had diverged .* use an earlier checkpoint")
    with pytest.raises(ValueError, match=rf"^checkpoint old.pt {message}"):
        model_from_checkpoint(CONFIG, state, "checkpoint old.pt")
    model = MODELS.build(MODEL, tokenizer=WordTokenizer(vocab=["a", "red", "circle"]))
    with pytest.raises(ValueError, match=rf"^load_from old.pt {message}"):
        load_matching_weights(model, state["model"], "load_from old.pt")


def test_a_safetensors_export_keeps_tied_weights_once_and_refuses_foreign_files(tmp_path):
    from safetensors.torch import save_file

    embedding = torch.randn(5, 3)
    state = {"model": {"embed.weight": embedding, "head.weight": embedding,
                       "head.bias": torch.zeros(5), "steps": torch.tensor(7)},
             "tokenizer": {"words": ["a", "b"]}, "config": {"lr": 1e-3, "tags": [1, "x"]},
             "epoch": 2}
    path = tmp_path / "model.safetensors"
    save_safetensors(state, path)
    with safe_open(str(path), framework="pt") as opened:
        assert sorted(opened.keys()) == ["embed.weight", "head.bias", "steps"]  # tied: once
    loaded = load_checkpoint(path)
    assert torch.equal(loaded["model"]["head.weight"], embedding)
    assert loaded["model"]["steps"].dtype == torch.int64
    assert {k: loaded[k] for k in ("tokenizer", "config", "epoch")} == \
        {k: state[k] for k in ("tokenizer", "config", "epoch")}
    save_file({"w": torch.ones(1)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="safetensors file but not an mmgoal export"):
        load_checkpoint(tmp_path / "other.safetensors")
    (tmp_path / "cut.safetensors").write_bytes(path.read_bytes()[:40])
    with pytest.raises(ValueError, match="cut.safetensors cannot be read"):
        load_checkpoint(tmp_path / "cut.safetensors")
