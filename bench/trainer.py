"""Trainer overhead: mmgoal's trainer against a bare PyTorch loop on the same work.

    python bench/trainer.py                  # quickstart model, 40 timed steps of 128
    python bench/trainer.py --profile        # also: torch.profiler's top entries of a trainer run

Both train the quickstart (``configs/quickstart.yaml``: CNN + GRU dual encoder, the
VSE++ triplet loss with the hardest negative, AdamW, cosine schedule with warm-up,
gradient clipping at 2) on fresh synthetic shards (2000 images), 128 images a
step, one data worker, no evaluation; the ``ObjectiveWarmup`` hook is left out so
both use the configured objective from the first step.

- mmgoal: ``Trainer(config).fit()``, everything it does per step included (the
  strategy's step with its non-finite checks, the schedule, hooks, metrics.jsonl
  every ``log_every`` steps, the progress bar off); the epoch's checkpoint is
  written after the timed steps.
- Baseline, "bare loop": what one writes by hand with the same pieces, built
  from the same config through the registries: the same ``ShardDataset`` in a
  ``DataLoader`` with one worker, the same model and objective,
  ``torch.optim.AdamW`` with the config's lr and weight decay, a ``LambdaLR``
  with the same warm-up, ``clip_grad_norm_``; the loss read every
  ``log_every`` steps.

Throughput is samples/s over ``--steps`` steps after ``--warmup`` steps (worker
start-up, the shuffle buffer's fill), the best of ``--repeats`` interleaved runs.
Prints both and the overhead ``1 - trainer / bare``. Measure on an idle machine:
with two cores, any other busy process slows a step several times.
"""

from __future__ import annotations

import argparse
import logging
import math
import tempfile
import time
from pathlib import Path

import torch

from mmgoal.data.pipeline import read_captions
from mmgoal.data.synthetic import write_benchmark
from mmgoal.data.transforms import build_transforms
from mmgoal.engine.hooks import Hook
from mmgoal.engine.trainer import Trainer
from mmgoal.objectives.mining import positives_from_groups
from mmgoal.registry import DATASETS, MODELS, OBJECTIVES, TOKENIZERS
from mmgoal.runs.schema import load_run_config
from mmgoal.structures import ObjectiveInputs

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "quickstart.yaml"


class StepTimes(Hook):
    """The time at the end of every step."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def after_step(self, trainer, outputs) -> None:
        self.times.append(time.perf_counter())


def config(shards: str, steps: int) -> dict:
    """The quickstart on ``shards`` for ``steps`` steps of its batch, no evaluation."""
    cfg = load_run_config(CONFIG, [f"data.train.shards={shards}", "data.val=null",
                                   "data.test=null", "train.epochs=1", "train.progress=false",
                                   "hooks=[]"])
    cfg["train"]["samples_per_epoch"] = steps * cfg["data"]["train"]["batch_size"]
    return cfg


def run_trainer(cfg: dict, work_dir: str, profile: bool = False) -> list[float]:
    trainer = Trainer(cfg, work_dir)
    timer = StepTimes()
    trainer.hooks.append(timer)
    if profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            trainer.fit()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    else:
        trainer.fit()
    return timer.times


def run_bare(cfg: dict, steps: int) -> list[float]:
    """The bare loop: the config's pieces, trained by hand."""
    data, train = cfg["data"], cfg["train"]
    torch.manual_seed(train["seed"])
    tokenizer = TOKENIZERS.build(data["tokenizer"]).fit(read_captions(data["train"]["shards"]))
    model = MODELS.build(cfg["model"], tokenizer=tokenizer)
    objective = OBJECTIVES.build(cfg["objective"], tokenizer=tokenizer)
    dataset = DATASETS.build(data["train"], tokenizer=tokenizer,
                             transform=build_transforms(None, data["image_size"]),
                             seed=train["seed"])
    loader = torch.utils.data.DataLoader(dataset, batch_size=None,
                                         num_workers=data["num_workers"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["optimizer"]["lr"],
                                  weight_decay=cfg["optimizer"]["weight_decay"])
    warmup = cfg["schedule"]["warmup_steps"]
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup)
        * 0.5 * (1 + math.cos(math.pi * step / steps)))
    model.train()
    times, losses = [], []
    for step, batch in enumerate(loader):
        if step == steps:
            break
        images, texts = model.encode_image(batch), model.encode_text(batch)
        sims = model.similarity(images, texts)
        loss = objective(ObjectiveInputs(sims, positives_from_groups(batch["image_groups"])))
        loss = sum(v for k, v in loss.items() if k.endswith("_loss"))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train["clip_grad"])
        optimizer.step()
        schedule.step()
        if (step + 1) % train["log_every"] == 0:
            losses.append(loss.item())
        times.append(time.perf_counter())
    return times


def rate(times: list[float], warmup: int, batch: int) -> float:
    """Samples/s from the end of step ``warmup`` to the end of the last step."""
    return (len(times) - 1 - warmup) * batch / (times[-1] - times[warmup])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="steps timed")
    parser.add_argument("--warmup", type=int, default=8, help="steps before the timing")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--profile", action="store_true",
                        help="then profile one trainer run with torch.profiler")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    total = args.warmup + args.steps
    with tempfile.TemporaryDirectory() as tmp:
        write_benchmark(tmp, {"train": 2000}, shard_size=250, progress=False)
        cfg = config(f"{tmp}/train-{{000000..000007}}.tar", total)
        batch = cfg["data"]["train"]["batch_size"]
        print(f"quickstart, {total} steps of {batch} ({args.warmup} untimed), "
              f"{cfg['data']['num_workers']} data worker, torch threads "
              f"{torch.get_num_threads()}")
        best = {"trainer": 0.0, "bare loop": 0.0}
        for repeat in range(args.repeats):
            times = run_trainer(cfg, f"{tmp}/run{repeat}")
            assert len(times) == total, f"the trainer took {len(times)} steps, not {total}"
            best["trainer"] = max(best["trainer"], rate(times, args.warmup, batch))
            best["bare loop"] = max(best["bare loop"],
                                    rate(run_bare(cfg, total), args.warmup, batch))
        for name, value in best.items():
            print(f"trainer {name:<10} {value:7.1f} samples/s")
        print(f"trainer: overhead vs the bare loop {1 - best['trainer'] / best['bare loop']:+.1%}"
              f" (ratio trainer / bare {best['trainer'] / best['bare loop']:.3f})")
        if args.profile:
            run_trainer(cfg, f"{tmp}/profile", profile=True)


if __name__ == "__main__":
    main()
