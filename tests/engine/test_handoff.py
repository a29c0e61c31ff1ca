"""A pretraining checkpoint starts a finetuning model: heads dropped, parts missing, listed."""

import pytest
import torch
from test_trainer import tiny_config  # same folder: pytest puts it on sys.path

from mmgoal.data.tokenizers import WordTokenizer
from mmgoal.engine.trainer import Trainer
from mmgoal.registry import MODELS
from mmgoal.runs.checkpoint import load_matching_weights, save_checkpoint, summarise_keys

# room for 40-token captions (test_pretraining_run.py trains it with the MiniLM tokenizer)
TINY = {"type": "XVLM", "fusion_layers": 1, "embed_dim": 16,
        "vision": {"model_name": "vit_tiny_patch16_224",
                   "model_kwargs": {"img_size": 32, "patch_size": 8, "embed_dim": 32,
                                    "depth": 1, "num_heads": 2}},
        "text": {"config": {"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 2,
                            "num_attention_heads": 2, "intermediate_size": 32,
                            "max_position_embeddings": 48}}}


def build(seed, **heads):
    torch.manual_seed(seed)
    tokenizer = WordTokenizer(vocab=["a", "red", "circle"])
    return MODELS.build({**TINY, **heads}, tokenizer=tokenizer)


def test_pretraining_heads_are_dropped_and_new_ones_listed():
    pretrained = build(0, mlm_head="separate", box_head=True)
    finetune = build(1, box_head=False)
    lists = load_matching_weights(finetune, pretrained.state_dict())
    assert lists["missing"] == []
    assert {k.split(".")[0] for k in lists["dropped"]} == {"mlm_transform", "mlm_decoder",
                                                           "box_head"}
    assert summarise_keys(lists["dropped"]) == "box_head (4), mlm_decoder (2), mlm_transform (4)"
    for name, tensor in finetune.state_dict().items():
        assert torch.equal(tensor, pretrained.state_dict()[name]), name
    # the other way: the finetuning model's heads keep their initial values
    grounded = build(2, box_head=True)
    initial = {k: v.clone() for k, v in grounded.state_dict().items()}
    lists = load_matching_weights(grounded, build(0).state_dict())
    assert lists["dropped"] == [] and {k.split(".")[0] for k in lists["missing"]} == {"box_head"}
    assert all(torch.equal(grounded.state_dict()[k], initial[k]) for k in lists["missing"])


def test_another_architecture_or_size_is_refused(tiny_benchmark, tmp_path):
    with pytest.raises(ValueError, match="shapes differ: .*hidden|no weight name in common"):
        load_matching_weights(build(0), {"encoder.weight": torch.zeros(2)})
    wider = {**TINY, "embed_dim": 8}
    torch.manual_seed(0)
    other = MODELS.build(wider, tokenizer=WordTokenizer(vocab=["a", "red", "circle"]))
    with pytest.raises(ValueError, match=r"shapes differ: vision_proj.weight \(8, 32\) vs "
                                         r"\(16, 32\)"):
        load_matching_weights(build(0), other.state_dict())
    out, _ = tiny_benchmark
    save_checkpoint({"model": build(0).state_dict(), "tokenizer": {"words": ["a"]},
                     "config": {"model": TINY}}, tmp_path / "xvlm.pt")
    cfg = tiny_config(out, epochs=1)
    cfg["load_from"] = str(tmp_path / "xvlm.pt")
    with pytest.raises(ValueError, match="a XVLM checkpoint cannot start a DualEncoder model"):
        Trainer(cfg, tmp_path / "run")
