"""End to end: mmgoal's trainer against open_clip's own trainer (open_clip_train.main).

    python bench/clip_train.py                       # 64 steps of 64, seeds 0 and 1
    python bench/clip_train.py --steps 128 --seeds 0 1 2 3

Both sides train the architecture of ``configs/clip/clip_tiny_synthetic.yaml``
(open_clip's ViT-B-32 shrunk: 4 layers of width 128 per tower, 64-pixel images,
32 text tokens) from the same initial weights (open_clip's init, seeded, saved
once), on the same img2dataset-style shards (png, txt, json; the synthetic
scenes, one caption each), with the same batch, AdamW (betas 0.9/0.98, eps
1e-6, weight decay 0.1 on matrices only), learning rate (1e-3, ``--warmup``
linear warm-up steps, then cosine to 0), fp32, one DataLoader worker, torch
``--threads`` and number of steps:

- open_clip: ``open_clip_train.main.main(argv)`` with its own argument list, its
  loop, data pipeline, loss (``ClipLoss`` on ``logit_scale``) and logging, as its
  users run it. A small wrapper registers the model config
  (``open_clip.add_model_config``) and hands its shard reader (written for
  webdataset 0.2) the tar expander without webdataset 1.x's end-of-shard marker,
  as bench/data.py does.
- mmgoal: ``mmgoal train clip/clip_tiny_synthetic`` with the same settings as
  ``--cfg-options`` (InfoNCE on the model's ``logit_scale``, ``caption_key: txt``),
  and ``data.train.exact_passes: true``, so that its epoch is one pass over the
  shards as open_clip's is (``--endless``: mmgoal's default stream, whose buffer
  runs across passes; docs/data.md, "What an epoch is").

The runs alternate (open_clip seed s, mmgoal seed s, next seed). Speed: each
side's median samples/s over its logged steps (every step, the first
``--skip`` left out: worker start-up, the shuffle buffers' fill), as each
trainer reports it (a step's wall time, data wait included). Recalls: each
final model evaluated by the same evaluator, ``mmgoal eval`` on the synthetic
test split (open_clip's checkpoint read through the config's
``model.pretrained``). Prints a line per run, then the median samples/s of
each side, their ratio, and the test rsum of each side over the seeds (mean,
min, max). Measure on an idle machine.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "clip/clip_tiny_synthetic"
MODEL = "mmgoal-clip-tiny"  # the name open_clip's side registers the architecture under
RATE = re.compile(r"Batch \(t\): [\d.]+, ([\d.]+)/s")


def architecture() -> dict:
    """ViT-B-32's open_clip config with clip_tiny_synthetic's model_kwargs on top."""
    import open_clip

    from mmgoal.config import merge_configs
    from mmgoal.runs.schema import load_model_config

    kwargs = load_model_config(ROOT / "configs" / f"{CONFIG}.yaml")["model"]["model_kwargs"]
    return merge_configs(open_clip.get_model_config("ViT-B-32"), kwargs)


def prepare(work: Path, samples: int, test: int) -> dict:
    """Train shards (img2dataset layout), the test split, the model config and the init."""
    import open_clip
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from data import write_shards  # bench/data.py

    from mmgoal.data.shards import ShardWriter
    from mmgoal.data.synthetic import iter_scenes, scene_sample

    train = write_shards(str(work / "train"), samples, max(samples // 8, 1), 64, "png")
    (work / "test").mkdir()
    with ShardWriter(work / "test", "test", max_count=test) as writer:
        for scene in iter_scenes("test", test):
            writer.write(scene_sample(scene, "test"))
    configs = work / "model_configs"
    configs.mkdir()
    (configs / f"{MODEL}.json").write_text(json.dumps(architecture()))
    open_clip.add_model_config(configs)
    torch.manual_seed(0)
    init = work / "init.pt"
    torch.save(open_clip.create_model(MODEL).state_dict(), init)
    return {"train": train, "test": str(work / "test" / "test-000000.tar"),
            "configs": str(configs), "init": str(init)}


def open_clip_worker(configs: str, argv: list[str]) -> None:
    """open_clip_train.main as its users run it, with the model config registered."""
    import open_clip
    import open_clip_train.data as open_clip_data
    from open_clip_train.main import main
    from webdataset.tariterators import tar_file_expander

    open_clip.add_model_config(configs)
    open_clip_data.tar_file_expander = functools.partial(tar_file_expander, eof_value=None)
    main(argv)


def run_open_clip(data: dict, work: Path, seed: int, args) -> dict:
    name = f"open_clip-{seed}"
    argv = ["--train-data", data["train"], "--train-num-samples", str(args.steps * args.batch_size),
            "--dataset-type", "webdataset", "--batch-size", str(args.batch_size), "--epochs", "1",
            "--lr", str(args.lr), "--wd", "0.1", "--beta1", "0.9", "--beta2", "0.98",
            "--eps", "1e-6", "--warmup", str(args.warmup), "--workers", "1",
            "--model", MODEL, "--pretrained", data["init"], "--precision", "fp32",
            "--seed", str(seed), "--logs", str(work / "logs"), "--name", name,
            "--save-frequency", "1", "--log-every-n-steps", "1", "--device", "cpu"]
    subprocess.run([sys.executable, __file__, "--open-clip-worker", data["configs"], *argv],
                   check=True, env=environment(args), capture_output=True, text=True)
    log = (work / "logs" / name / "out.log").read_text()
    rates = [float(rate) for rate in RATE.findall(log)]
    checkpoint = work / "logs" / name / "checkpoints" / "epoch_1.pt"
    return {"rates": rates, "test": evaluate(work, data, {"model.pretrained": str(checkpoint)},
                                             name, args)}


def common_options(data: dict) -> list[str]:
    """The settings both of mmgoal's commands take: the model and the data it reads."""
    return ["model.pretrained=" + data["init"], f"data.test.shards={data['test']}",
            "data.val=null", "data.num_workers=1"]


def run_mmgoal(data: dict, work: Path, seed: int, args) -> dict:
    run = work / f"mmgoal-{seed}"
    steps = args.steps
    options = [*common_options(data), f"data.train.shards={data['train']}",
               "data.train.caption_key=txt", f"data.train.batch_size={args.batch_size}",
               f"train.samples_per_epoch={steps * args.batch_size}", "train.epochs=1",
               f"train.seed={seed}", "train.log_every=1", "train.precision=fp32",
               "train.eval_before_training=false", "optimizer.lr=" + str(args.lr),
               "optimizer.weight_decay=0.1", "schedule.warmup_ratio=0",
               f"schedule.warmup_steps={args.warmup}",
               f"data.train.exact_passes={str(not args.endless).lower()}"]
    subprocess.run([sys.executable, "-m", "mmgoal", "train", CONFIG, "--work-dir", str(run),
                    "--cfg-options", *options], check=True, cwd=work,
                   env=environment(args), capture_output=True, text=True)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rates = [r["samples_per_s"] for r in records if "samples_per_s" in r]
    return {"rates": rates, "test": evaluate(work, data, {}, run.name, args, run)}


def evaluate(work: Path, data: dict, options: dict, name: str, args, run: Path | None = None
             ) -> dict:
    """Test metrics from ``mmgoal eval``: of a run folder, or of the config's model with
    ``options`` (open_clip's checkpoint as ``model.pretrained``)."""
    out = work / f"{name}-test.json"
    target = [str(run)] if run is not None else [CONFIG, "--cfg-options",
                                                 *common_options(data),
                                                 *(f"{k}={v}" for k, v in options.items())]
    subprocess.run([sys.executable, "-m", "mmgoal", "eval", *target, "--split", "test",
                    "--out", str(out)], check=True, cwd=work,
                   env=environment(args), capture_output=True, text=True)
    return json.loads(out.read_text())["metrics"]


def environment(args) -> dict:
    threads = str(args.threads)
    return {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
            "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def median_rate(rates: list[float], skip: int) -> float:
    return statistics.median(rates[skip:] or rates)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--open-clip-worker":
        open_clip_worker(sys.argv[2], sys.argv[3:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=6, help="linear warm-up steps")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each side")
    parser.add_argument("--skip", type=int, default=4,
                        help="logged steps left out of the median samples/s")
    parser.add_argument("--samples", type=int, default=4096, help="images in the train shards")
    parser.add_argument("--test", type=int, default=500, help="images in the test split")
    parser.add_argument("--endless", action="store_true",
                        help="mmgoal's default endless stream instead of exact passes")
    parser.add_argument("--work", help="folder for the shards and runs (default: a temporary one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as temporary:
        work = Path(args.work or temporary)
        work.mkdir(parents=True, exist_ok=True)
        data = prepare(work, args.samples, args.test)
        results: dict[str, list[dict]] = {"open_clip": [], "mmgoal": []}
        for seed in args.seeds:
            for side, run in (("open_clip", run_open_clip), ("mmgoal", run_mmgoal)):
                result = run(data, work, seed, args)
                results[side].append(result)
                test = result["test"]
                print(f"{side:<9} seed {seed}: {median_rate(result['rates'], args.skip):6.1f} "
                      f"samples/s over {len(result['rates'])} logged steps; test R@1 i2t "
                      f"{test['i2t_r1']:.1f} t2i {test['t2i_r1']:.1f} rsum {test['rsum']:.1f}",
                      flush=True)
    speed = {side: statistics.median(median_rate(r["rates"], args.skip) for r in runs)
             for side, runs in results.items()}
    print(f"\n{args.steps} steps of {args.batch_size}, {args.threads} thread(s), "
          f"{len(args.seeds)} seed(s) per side, mmgoal "
          f"{'endless stream' if args.endless else 'exact passes'}")
    for side, runs in results.items():
        rsums = [r["test"]["rsum"] for r in runs]
        print(f"{side:<9} {speed[side]:6.1f} samples/s; test rsum mean {statistics.mean(rsums):.1f}"
              f" (min {min(rsums):.1f}, max {max(rsums):.1f}): "
              + ", ".join(f"{value:.1f}" for value in rsums))
    print(f"clip_train: mmgoal / open_clip_train samples/s ratio "
          f"{speed['mmgoal'] / speed['open_clip']:.2f}")


if __name__ == "__main__":
    main()
