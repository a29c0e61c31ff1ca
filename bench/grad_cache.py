"""Gradient caching against plain steps: the peak memory and the time of a training step.

    python bench/grad_cache.py                      # batch 2048, chunk 128, 32-px images
    python bench/grad_cache.py --batch 1024 --chunk 64 --repeats 1

The quickstart dual encoder (``configs/quickstart.yaml``: a 4-stage CNN, with group norm
here, and a bidirectional GRU, 512-d) with GOAL ``cir x sig_ms``, on random images and captions,
one process and one thread. Each mode runs in a process of its own (so each peak is
its own): the forward and backward of mmgoal's ``TrainingStep`` (no optimizer), the
best of ``--repeats`` steps after one untimed step:

- ``plain small``: a plain step of ``--chunk`` pairs, the memory baseline: what a batch
  of one chunk needs;
- ``plain``: a plain step of ``--batch`` pairs, the time baseline (its whole graph alive
  at once);
- ``cached``: ``--batch`` pairs under ``train.grad_cache_chunk: --chunk``
  (docs/distributed.md, "Gradient caching"): encoded chunk by chunk without a graph,
  the objective on the whole batch, each chunk encoded again and back-propagated.

Then the same against open_clip's own ``--accum-freq`` (``open_clip_train``'s
``train_one_epoch``, which caches every micro-batch's features and then, for each
micro-batch, encodes it again and computes the whole loss, ``ClipLoss``): one AdamW step
of ``--clip-batch`` pairs of the tiny CLIP of ``configs/clip/clip_tiny_synthetic.yaml``
in ``--clip-chunk``-pair pieces, against mmgoal's torch strategy with
``train.grad_cache_chunk`` (InfoNCE on the model's logit_scale), same model, same data.

Printed: each mode's CPU seconds (``time.process_time``) and the rise of its peak
resident memory over its steps (from when the model and the batch are built), then the
ratios (goals: the cached step's peak at most 1.5x the small plain step's, its time at
most 1.4x the plain step's).
"""

from __future__ import annotations

import argparse
import random
import resource
import time
from pathlib import Path

import torch
from ranks import joined, run_ranks  # bench/ranks.py

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "quickstart.yaml"
WORDS = ("a an the red green blue yellow small large circle square star cross triangle left "
         "right of above below next to two three shapes on background").split()
MODES = ("plain small", "plain", "cached")


def worker(rank: int, port: int, args: tuple, queue) -> None:
    mode, batch_size, chunk, image_size, repeats = args
    with joined(rank, port, 1):
        from mmgoal.config import load_config
        from mmgoal.data.pipeline import image_id_groups
        from mmgoal.data.tokenizers import WordTokenizer
        from mmgoal.engine.step import TrainingStep
        from mmgoal.registry import MODELS, OBJECTIVES

        cfg = load_config(CONFIG)
        cfg["model"]["image_encoder"]["model_kwargs"]["norm"] = "group"  # no BatchNorm
        tokenizer = WordTokenizer().fit([" ".join(WORDS)])
        torch.manual_seed(0)
        model = MODELS.build(cfg["model"], tokenizer=tokenizer)
        objective = OBJECTIVES.build({"type": "GoalObjective", "triplet": "cir",
                                      "pair": "sig_ms"})
        size = chunk if mode == "plain small" else batch_size
        step = TrainingStep(model, objective,
                            grad_cache_chunk=chunk if mode == "cached" else None).train()
        rng = random.Random(0)

        def batch() -> dict:
            ids = list(range(size))
            captions = [" ".join(rng.choices(WORDS, k=rng.randint(4, 14))) for _ in ids]
            return {"images": torch.randn(size, 3, image_size, image_size),
                    **tokenizer(captions), "image_ids": ids, "image_groups": image_id_groups(ids),
                    "skipped": 0}

        def run(data: dict) -> None:
            if mode != "cached":
                step(data)["loss"].backward()
                return
            _, cache = step.cache_gradients(data)
            for index in range(len(cache.chunks)):
                step(data, replay=(cache, index))["loss"].backward()

        data = batch()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # model and data built
        best = float("inf")
        for repeat in range(repeats + 1):  # the first untimed: first-call allocations
            if not repeat:
                run(data)
                step.zero_grad(set_to_none=True)
                continue
            start = time.process_time()
            run(data)
            best = min(best, time.process_time() - start)
            step.zero_grad(set_to_none=True)
        rise = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
        queue.put((best, rise))


CLIP_MODES = ("open_clip accum_freq", "mmgoal grad_cache")


class Batches(list):
    """What open_clip's ``train_one_epoch`` reads of a DataLoader: the batches, their
    count and the samples of an epoch."""

    num_batches = property(len)

    @property
    def num_samples(self) -> int:
        return sum(len(images) for images, _ in self)


def clip_worker(rank: int, port: int, args: tuple, queue) -> None:
    """One step of ``batch`` pairs of the tiny CLIP in ``chunk``-pair pieces: open_clip's
    own ``--accum-freq`` loop (``open_clip_train.train.train_one_epoch``, one epoch of
    ``batch / chunk`` micro-batches, ``ClipLoss``), or mmgoal's torch strategy with
    ``train.grad_cache_chunk`` (InfoNCE on the model's logit_scale); AdamW on both."""
    from argparse import Namespace

    mode, batch_size, chunk, repeats = args
    with joined(rank, port, 1):
        from mmgoal.config import load_config
        from mmgoal.engine.step import TrainingStep
        from mmgoal.engine.strategies.torch_native import TorchStrategy
        from mmgoal.registry import MODELS, OBJECTIVES

        cfg = load_config(ROOT / "configs" / "clip" / "clip_tiny_synthetic.yaml")
        torch.manual_seed(0)
        model = MODELS.build(cfg["model"])
        generator = torch.Generator().manual_seed(1)
        images = torch.randn(batch_size, 3, 64, 64, generator=generator)
        tokens = torch.randint(1, 49407, (batch_size, 32), generator=generator)
        if mode == "mmgoal grad_cache":
            strategy = TorchStrategy(device="cpu")
            strategy.setup(TrainingStep(model, OBJECTIVES.build(cfg["objective"], model=model),
                                        grad_cache_chunk=chunk),
                           {"type": "AdamW", "lr": 1e-4}, batch_size, 1, None)
            ids = list(range(batch_size))
            batch = {"images": images, "tokens": tokens, "image_ids": ids,
                     "image_groups": torch.arange(batch_size), "skipped": 0}

            def step() -> None:
                strategy.train_step([batch])
        else:
            import open_clip
            from open_clip_train.data import DataInfo
            from open_clip_train.train import train_one_epoch

            clip = model.model  # the same open_clip CLIP that mmgoal's OpenCLIP wraps
            clip.output_dict = True  # as open_clip_train creates it
            optimizer = torch.optim.AdamW(clip.parameters(), lr=1e-4)
            micro = Batches((images[i:i + chunk], tokens[i:i + chunk])
                            for i in range(0, batch_size, chunk))
            options = Namespace(device="cpu", precision="fp32", distill=False,
                                accum_freq=len(micro), skip_scheduler=True, horovod=False,
                                grad_clip_norm=None, log_every_n_steps=10**9, rank=0,
                                world_size=1, batch_size=chunk, wandb=False)
            loss = open_clip.ClipLoss()

            def step() -> None:
                train_one_epoch(clip, {"train": DataInfo(micro)}, loss, 0, optimizer, None,
                                lambda _: None, None, options)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        best = float("inf")
        for repeat in range(repeats + 1):  # the first untimed
            start = time.process_time()
            step()
            if repeat:
                best = min(best, time.process_time() - start)
        queue.put((best, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--clip-batch", type=int, default=1024,
                        help="the CLIP comparison's batch (0: leave it out)")
    parser.add_argument("--clip-chunk", type=int, default=128)
    args = parser.parse_args(argv)
    if args.clip_batch:
        clip = {mode: run_ranks(clip_worker, (mode, args.clip_batch, args.clip_chunk,
                                              args.repeats), 1) for mode in CLIP_MODES}
        for mode, (seconds, rise) in clip.items():
            print(f"tiny CLIP, {args.clip_batch} pairs in chunks of {args.clip_chunk}, {mode}: "
                  f"{seconds:.2f} s, peak +{rise:.0f} MiB", flush=True)
        ours, theirs = clip["mmgoal grad_cache"], clip["open_clip accum_freq"]
        print(f"grad_cache against open_clip --accum-freq {args.clip_batch // args.clip_chunk}: "
              f"ratio time {ours[0] / theirs[0]:.2f}, peak memory "
              f"{ours[1] / max(theirs[1], 1e-9):.2f}", flush=True)
    results = {}
    for mode in MODES:
        results[mode] = run_ranks(worker, (mode, args.batch, args.chunk, args.image_size,
                                           args.repeats), 1)
        size = args.chunk if mode == "plain small" else args.batch
        print(f"{mode} ({size} pairs): {results[mode][0]:.2f} s, peak +{results[mode][1]:.0f} "
              f"MiB", flush=True)
    cached, plain, small = results["cached"], results["plain"], results["plain small"]
    print(f"grad_cache batch {args.batch} chunk {args.chunk}: ratio time "
          f"{cached[0] / plain[0]:.2f} (to the plain step of {args.batch}), peak memory "
          f"{cached[1] / max(small[1], 1e-9):.2f} (to the plain step of {args.chunk}; "
          f"{cached[1] / max(plain[1], 1e-9):.2f} to that of {args.batch})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
