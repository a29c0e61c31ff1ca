"""Evaluation throughput: encoding images/s and texts/s, and gallery memory per 1,000 items.

    python bench/eval.py                                  # 512 images, 2,560 captions
    python bench/eval.py --images 1000 --repeats 5
    python bench/eval.py --models quickstart --batch-size 128

Models, each built from its config with random weights (the project's
``build_from_config``; the word vocabulary is fitted on the bench gallery's
captions): ``quickstart``, the dual encoder of configs/quickstart.yaml (small
CNN + biGRU, 512-d), and ``scan``, configs/scan/scan_synthetic.yaml (RoIAlign
regions of the scenes' boxes plus the whole image on the same CNN, biGRU words,
256-d). Gallery: ``--images`` synthetic scenes x 5 captions at the config's
image size, written as shards to a temporary folder. Each model is measured in
a fresh process (its peak RSS is its own).

- mmgoal: ``encode_gallery`` on the shards, the path of ``mmgoal eval``
  and of validation: shard reading, image decoding, the eval transform, the
  tokenizer, the model, storing the features; with each of ``--workers``
  (default 0 and 2) DataLoader workers decoding the images while the model
  encodes (``data.num_workers``). images/s counts up to the end of
  the last ``encode_image`` call, texts/s the rest (tokenizing included).
- Baseline, "bare": a ``torch.no_grad()`` loop calling ``model.encode_image`` /
  ``model.encode_text`` on the same batches, already read, decoded,
  transformed and tokenized in memory.
- ratio mmgoal / bare of the throughputs (the best of ``--repeats``), and what
  the difference is made of: the shards read, decoded and transformed without
  the model (images/s), the tokenizer alone (texts/s).
- memory: bytes of the stored gallery features (embedding, tokens, masks) per
  1,000 images and per 1,000 captions, with the ratio to the dual encoder's
  (tokens are padded to the gallery's longest item: the share of padding rows
  is printed); the peak RSS increase of the first ``encode_gallery``
  (``ru_maxrss``), which also holds one batch's activations and the
  concatenation's copy of the features.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"quickstart": ROOT / "configs/quickstart.yaml",
           "scan": ROOT / "configs/scan/scan_synthetic.yaml"}
BASELINE_MODEL = "quickstart"  # the memory ratios are against its gallery


def features_bytes(features) -> dict[str, int]:
    """Bytes of each stored tensor of ``ImageFeatures``/``TextFeatures``."""
    out = {}
    for name in ("embedding", "tokens", "mask"):
        tensor = getattr(features, name)
        if tensor is not None:
            out[name] = tensor.element_size() * tensor.numel()
    return out


def shapes(features) -> dict[str, list[int]]:
    return {name: list(getattr(features, name).shape) for name in ("embedding", "tokens", "mask")
            if getattr(features, name) is not None}


def padding_share(features) -> float:
    """The share of stored token rows that are padding (0 without tokens)."""
    if features.mask is None:
        return 0.0
    return 1 - features.mask.sum().item() / features.mask.numel()


def build(name: str, shards: str):
    """The model of ``name``'s config, random weights, vocabulary fitted on the shards."""
    import torch

    from mmgoal.data.pipeline import read_captions
    from mmgoal.data.tokenizers import WordTokenizer
    from mmgoal.runs.loading import build_from_config
    from mmgoal.runs.schema import load_model_config

    cfg = load_model_config(CONFIGS[name])
    tokenizer = dict(cfg["data"]["tokenizer"])
    if tokenizer["type"] == "WordTokenizer" and not tokenizer.get("vocab"):
        fitted = WordTokenizer(min_count=tokenizer.get("min_count", 1)).fit(read_captions(shards))
        tokenizer["vocab"] = fitted.words[2:]  # without <pad>, <unk>
    cfg["data"]["tokenizer"] = tokenizer
    torch.manual_seed(0)
    return build_from_config(cfg, device="cpu")


def measure(name: str, shards: str, batch_size: int | None, repeats: int,
            workers: int = 0) -> dict:
    """Every number of one model (run in its own process)."""
    import torch

    from mmgoal.data.pipeline import EvalReader, iter_eval_batches
    from mmgoal.evaluation.gallery import encode_gallery

    loaded = build(name, shards)
    model, transform, tokenizer = loaded.model.eval(), loaded.transform, loaded.tokenizer
    batch_size = batch_size or loaded.config["data"]["eval_batch_size"]
    marks: dict[str, float] = {}
    encode_image = model.encode_image

    def timed_encode_image(batch):  # the end of the image phase of encode_gallery
        features = encode_image(batch)
        marks["images_done"] = time.perf_counter()
        return features

    def run_mmgoal():
        model.encode_image = timed_encode_image  # an instance attribute: encode_gallery's call
        try:
            start = time.perf_counter()
            gallery = encode_gallery(model, EvalReader(shards, batch_size, num_workers=workers),
                                     transform, tokenizer, progress=False)
            end = time.perf_counter()
        finally:
            del model.encode_image
        return gallery, marks["images_done"] - start, end - marks["images_done"]

    # The first run is not warmed up, so that its peak RSS is its own; the timings are
    # the best of the runs (with repeats >= 2, a warm one).
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    gallery, image_s, text_s = run_mmgoal()
    rss_peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before

    start = time.perf_counter()  # the data alone: read, decode, transform (and keep) batches
    image_batches = list(iter_eval_batches(EvalReader(shards, batch_size), transform))
    read_s = time.perf_counter() - start
    captions = gallery.captions
    start = time.perf_counter()
    text_batches = [tokenizer(captions[i:i + batch_size])
                    for i in range(0, len(captions), batch_size)]
    tokenize_s = time.perf_counter() - start

    def run_bare():
        with torch.no_grad():
            start = time.perf_counter()
            images = [model.encode_image(batch) for batch in image_batches]
            middle = time.perf_counter()
            texts = [model.encode_text(batch) for batch in text_batches]
            end = time.perf_counter()
        del images, texts
        return middle - start, end - middle

    best = {"mmgoal": [image_s, text_s], "bare": [float("inf"), float("inf")]}
    for repeat in range(repeats):  # interleaved, so that a load change hits both
        bare = run_bare()
        best["bare"] = [min(a, b) for a, b in zip(best["bare"], bare)]
        if repeat < repeats - 1:
            _, *ours = run_mmgoal()
            best["mmgoal"] = [min(a, b) for a, b in zip(best["mmgoal"], ours)]
    return {
        "model": name, "type": loaded.config["model"]["type"], "batch_size": batch_size,
        "workers": workers,
        "images": len(gallery.image_ids), "captions": len(captions), "seconds": best,
        "read_s": read_s, "tokenize_s": tokenize_s, "rss_peak_kib": rss_peak_kib,
        "image_bytes": features_bytes(gallery.images), "text_bytes": features_bytes(gallery.texts),
        "image_shapes": shapes(gallery.images), "text_shapes": shapes(gallery.texts),
        "image_padding": padding_share(gallery.images),
        "text_padding": padding_share(gallery.texts),
    }


def run_worker(name: str, shards: str, batch_size: int | None, repeats: int,
               workers: int) -> dict:
    command = [sys.executable, __file__, "--worker", name, shards, "--repeats", str(repeats),
               "--workers", str(workers)]
    if batch_size:
        command += ["--batch-size", str(batch_size)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"worker {name} failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def per_thousand(total: float, count: int) -> float:
    return total / count * 1000


def report(r: dict, baseline: dict | None) -> None:
    (image_s, text_s), (bare_image_s, bare_text_s) = r["seconds"]["mmgoal"], r["seconds"]["bare"]
    n_i, n_t = r["images"], r["captions"]
    print(f"\n{r['model']} ({r['type']}), batch {r['batch_size']}, {n_i} images, "
          f"{n_t} captions, decoded by {r['workers']} DataLoader worker(s) (0: in the "
          f"model's process)")
    print(f"  {r['model']} images/s, {r['workers']} workers: mmgoal encode_gallery "
          f"{n_i / image_s:,.0f}, bare encode_image {n_i / bare_image_s:,.0f}; ratio mmgoal / "
          f"bare {bare_image_s / image_s:.2f}")
    print(f"  {r['model']} texts/s:  mmgoal encode_gallery {n_t / text_s:,.0f}, bare encode_text "
          f"{n_t / bare_text_s:,.0f}; ratio mmgoal / bare {bare_text_s / text_s:.2f}")
    print(f"  the data alone: shards read + decoded + transformed {n_i / r['read_s']:,.0f} "
          f"images/s ({r['read_s']:.2f} s, {r['read_s'] / image_s:.0%} of mmgoal's image "
          f"time); tokenizer {n_t / r['tokenize_s']:,.0f} texts/s ({r['tokenize_s']:.2f} s, "
          f"{r['tokenize_s'] / text_s:.0%} of mmgoal's text time)")
    for side, count, key in (("images", n_i, "image"), ("captions", n_t, "text")):
        parts = r[f"{key}_bytes"]
        total = per_thousand(sum(parts.values()), count)
        detail = ", ".join(f"{name} {r[f'{key}_shapes'][name][1:] or ['1']} "
                           f"{per_thousand(size, count) / 2**20:.2f} MiB"
                           for name, size in parts.items())
        ratio = ""
        if baseline is not None:
            base = per_thousand(sum(baseline[f"{key}_bytes"].values()), baseline[
                "images" if key == "image" else "captions"])
            ratio = f"; ratio to {baseline['model']}'s {total / base:.2f}"
        padding = r[f"{key}_padding"]
        padded = f"; {padding:.0%} of the token rows are padding" if padding else ""
        print(f"  {r['model']} stored features per 1,000 {side}: {total / 2**20:.2f} MiB "
              f"({total / 1000:,.0f} bytes each: {detail}{padded}){ratio}")
    stored = sum(r["image_bytes"].values()) + sum(r["text_bytes"].values())
    print(f"  peak RSS increase of encode_gallery: {r['rss_peak_kib'] / 1024:.1f} MiB "
          f"(of which stored features: {stored / 2**20:.1f} MiB)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=512, help="gallery images (x 5 captions)")
    parser.add_argument("--models", nargs="+", choices=sorted(CONFIGS),
                        default=["quickstart", "scan"])
    parser.add_argument("--batch-size", type=int, default=None,
                        help="images or captions per batch (default: data.eval_batch_size)")
    parser.add_argument("--repeats", type=int, default=3, help="the best of how many runs")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2],
                        help="DataLoader workers decoding the gallery, each measured "
                             "(data.num_workers; 0: in the model's process)")
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "SHARDS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(measure(args.worker[0], args.worker[1], args.batch_size, args.repeats,
                                 args.workers[0])))
        return
    import torch

    from mmgoal.data.synthetic import write_benchmark
    from mmgoal.runs.schema import load_model_config

    image_size = load_model_config(CONFIGS[args.models[0]])["data"]["image_size"]
    if any(load_model_config(CONFIGS[m])["data"]["image_size"] != image_size
           for m in args.models):
        raise SystemExit("the models' configs ask for different image sizes")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; gallery "
          f"{args.images} synthetic scenes x 5 captions, {image_size} px")
    with tempfile.TemporaryDirectory(prefix="mmgoal_bench_eval_") as folder:
        summary = write_benchmark(folder, {"test": args.images}, image_size=image_size,
                                  progress=False)
        shards = str(Path(folder) / summary["splits"]["test"]["pattern"])
        baseline = None
        for name in args.models:
            for workers in args.workers:
                result = run_worker(name, shards, args.batch_size, args.repeats, workers)
                report(result, baseline if name != BASELINE_MODEL else None)
                if name == BASELINE_MODEL and baseline is None:
                    baseline = result


if __name__ == "__main__":
    main()
