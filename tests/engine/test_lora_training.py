"""A LoRA model (``model.peft``) in training: the run says what trains, its checkpoints hold
the adapters and resume them exactly, and under DDP and DeepSpeed ZeRO-2 the frozen weights
stay put while the adapters move alike on every rank."""

import copy
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from clip_runs import MODEL_KWARGS
from ranks import run_ranks  # tests/ranks.py

from mmgoal.distributed import id_hashes
from mmgoal.engine.step import TrainingStep
from mmgoal.engine.trainer import Trainer
from mmgoal.registry import MODELS, OBJECTIVES
from mmgoal.runs.checkpoint import load_checkpoint

pytest.importorskip("open_clip")
pytest.importorskip("peft")

TINY = copy.deepcopy(MODEL_KWARGS)  # ViT-B-32 shrunk to one block of width 32 per tower
MODEL = {"type": "OpenCLIP", "model_name": "ViT-B-32", "model_kwargs": TINY,
         "peft": {"type": "lora", "r": 4, "alpha": 8}}
# A (4, 32) and B (96, 4) on each tower's attn.in_proj_weight, and logit_scale
TRAINABLE = 2 * (4 * 32 + 96 * 4) + 1


def trains(name: str) -> bool:
    return ".lora_" in name or name == "model.logit_scale"


def lora_config(out: Path, epochs: int) -> dict:
    return {"model": MODEL, "objective": {"type": "InfoNCELoss"},
            "optimizer": {"type": "AdamW", "lr": 1e-2},
            "data": {"num_workers": 0, "image_size": None, "tokenizer": None,
                     "train": {"type": "ShardDataset", "batch_size": 16, "shuffle_buffer": 32,
                               "shards": str(out / "train-{000000..000002}.tar")},
                     "val": {"shards": str(out / "val-000000.tar")}},
            "train": {"epochs": epochs, "samples_per_epoch": 48, "progress": False,
                      "log_every": 1}}


def test_a_lora_run_reports_what_trains_and_resumes_its_adapters_exactly(tiny_benchmark,
                                                                          tmp_path, caplog):
    out, _ = tiny_benchmark
    caplog.set_level("INFO", logger="mmgoal")
    trainer = Trainer(lora_config(out, 2), tmp_path / "straight")
    initial = {name: value.clone() for name, value in trainer.model.state_dict().items()}
    report = trainer.fit()
    final = load_checkpoint(tmp_path / "straight" / "checkpoints" / "last.pt")["model"]
    # the checkpoint holds the frozen weights as they were and the adapters as trained
    assert {name for name in initial if not torch.equal(initial[name], final[name])} == \
        {name for name in initial if trains(name)} != set()
    total = sum(value.numel() for value in initial.values())
    assert report["parameters"] == {"trainable": TRAINABLE, "total": total}
    assert json.loads((tmp_path / "straight" / "report.json").read_text())["parameters"] == \
        report["parameters"]
    # said as the run starts
    assert f"epoch 0: trainable parameters: {TRAINABLE} of {total} (0.06%)" in caplog.messages
    assert "model.peft of OpenCLIP ViT-B-32: LoRA r 4, alpha 8 on 0 layer(s) and 2 weight(s) " \
           f"(attn.in_proj_weight); trained: the adapters and logit_scale, {TRAINABLE} " \
           "parameters" in caplog.messages
    # one epoch, then resumed for the second: the uninterrupted run's weights, bit for bit
    Trainer(lora_config(out, 1), tmp_path / "cut").fit()
    Trainer(lora_config(out, 2), tmp_path / "cut", resume=True).fit()
    resumed = load_checkpoint(tmp_path / "cut" / "checkpoints" / "last.pt")["model"]
    assert resumed.keys() == final.keys()
    assert all(torch.equal(resumed[name], final[name]) for name in final)


def test_a_freeze_schedule_thaws_the_adapters_and_leaves_the_lora_base_frozen():
    from types import SimpleNamespace

    from mmgoal.engine.hooks import FreezeSchedule

    model = MODELS.build(MODEL)
    hook = FreezeSchedule(frozen=["model.visual"], unfreeze={1: ["model.visual"]})
    trainable = []
    for epoch in range(2):
        hook.before_epoch(SimpleNamespace(model=model, epoch=epoch))
        trainable.append({n for n, p in model.named_parameters() if p.requires_grad})
    text = {name for name, _ in model.named_parameters() if trains(name)
            and not name.startswith("model.visual.")}
    assert trainable[0] == text  # the image tower's adapters wait; its base never trains
    assert trainable[1] == {name for name, _ in model.named_parameters() if trains(name)}


def rank_batch(rank: int, index: int, size: int = 4) -> dict:
    """This rank's pairs of step ``index``: random images and tokens, one image per caption."""
    generator = torch.Generator().manual_seed(100 * index + rank)
    ids = [f"{rank}-{index}-{i}" for i in range(size)]
    return {"images": torch.randn(size, 3, 32, 32, generator=generator),
            "tokens": torch.randint(1, 49407, (size, 16), generator=generator),
            "image_ids": ids, "image_groups": id_hashes(ids), "skipped": 0}


def lora_rank(rank: int, world: int, kind: str) -> dict:
    """Three AdamW steps of the LoRA model under DDP (``torch``) or DeepSpeed ZeRO-2 on this
    rank's pairs: the model's weights before and after, and the strategy's full weights."""
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    if kind == "deepspeed":
        from mmgoal.engine.strategies.deepspeed import DeepSpeedStrategy

        strategy = DeepSpeedStrategy(zero_stage=2, device="cpu")
    else:
        from mmgoal.engine.strategies.torch_native import TorchStrategy

        strategy = TorchStrategy(device="cpu")
    torch.manual_seed(0)  # the same weights and adapters on every rank, as the trainer seeds
    model = MODELS.build(MODEL)
    initial = {name: value.clone() for name, value in model.state_dict().items()}
    step = TrainingStep(model, OBJECTIVES.build({"type": "InfoNCELoss"}, model=model))
    strategy.setup(step, {"type": "AdamW", "lr": 1e-2}, 4, 1, None)
    held = sum(p.numel() for group in strategy.param_groups() for p in group["params"])
    applied = [strategy.train_step([rank_batch(rank, index)]).applied for index in range(3)]
    return {"initial": initial, "final": {k: v.clone() for k, v in model.state_dict().items()},
            "full": strategy.full_state_dict(), "applied": applied, "held": held}


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["torch", "deepspeed"])
def test_under_ddp_and_zero2_the_base_stays_and_the_adapters_move_alike(tmp_path, monkeypatch,
                                                                        kind):
    if kind == "deepspeed":
        pytest.importorskip("deepspeed")
        monkeypatch.setenv("DS_ACCELERATOR", "cpu")
        # DeepSpeed's CPU communication extension, built once where the distributed tests do
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", os.environ.get(
            "TORCH_EXTENSIONS_DIR", str(Path(sys.executable).parent.parent / "torch_extensions")))
    ranks = run_ranks(lora_rank, tmp_path, kind)
    for result in ranks:
        assert result["applied"] == [True] * 3
        initial, final = result["initial"], result["final"]
        moved = {name for name in initial if not torch.equal(initial[name], final[name])}
        assert moved == {name for name in initial if trains(name)}  # the frozen base stayed
        assert all(final[name].abs().sum() > 0 for name in final if ".lora_B." in name)
    if kind == "deepspeed":  # ZeRO-2 shares what it optimises out, padded to split evenly
        assert TRAINABLE <= sum(result["held"] for result in ranks) < TRAINABLE + 8
    else:
        assert all(result["held"] == TRAINABLE for result in ranks)
    one, other = (result["final"] for result in ranks)
    assert all(torch.equal(one[name], other[name]) for name in one)  # every rank alike
    full = ranks[0]["full"]  # what checkpoints and exports hold
    assert full.keys() == one.keys() and all(torch.equal(full[name], one[name]) for name in one)
