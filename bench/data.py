"""Training data throughput against a bare read of the same tar files.

    python bench/data.py [--shards 'data/synthetic/train-*.tar'] [--workers 0 2]

Baseline: ``tarfile`` reading every member's bytes (no decoding), in this
process. Measured: the training pipeline (tar -> samples -> shuffle -> image
decode -> transform -> tokenize -> batch) through the trainer's DataLoader with
0 workers (in this process) and with 2 worker processes. Prints samples/s of
each and its ratio to the bare read; the gap is the price of decoding and
batching, which workers spread over cores.
"""

from __future__ import annotations

import argparse
import itertools
import tarfile
import tempfile
import time

import torch

from mmgoal.data.pipeline import ShardDataset, expand_shards, read_captions
from mmgoal.data.synthetic import write_benchmark
from mmgoal.data.tokenizers import WordTokenizer
from mmgoal.data.transforms import build_transforms


def raw_tar_read(urls: list[str]) -> int:
    samples = set()
    for url in urls:
        with tarfile.open(url) as archive:
            for member in archive:
                if member.isfile():
                    archive.extractfile(member).read()
                    samples.add((url, member.name.split(".", 1)[0]))
    return len(samples)


def pipeline_read(urls: list[str], tokenizer: WordTokenizer, batch_size: int, samples: int,
                  workers: int) -> int:
    """One epoch of the training stream (which itself never ends): ``samples`` // batch."""
    dataset = ShardDataset(urls, batch_size, tokenizer, build_transforms(None, 64))
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=workers)
    return sum(len(batch["captions"])
               for batch in itertools.islice(loader, samples // batch_size))


def timed(fn, *args) -> tuple[int, float]:
    start = time.perf_counter()
    count = fn(*args)
    return count, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shards", help="shards to read (default: 2000 fresh synthetic images)")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2],
                        help="DataLoader worker counts to measure")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.shards is None:
            write_benchmark(tmp, {"train": 2000}, shard_size=500, progress=False)
            args.shards = f"{tmp}/train-*.tar"
        urls = expand_shards(args.shards)
        raw_tar_read(urls)  # warm the page cache for both readers
        n_raw, t_raw = timed(raw_tar_read, urls)
        rows = [("bare tar read (baseline)", n_raw, t_raw)]
        tokenizer = WordTokenizer().fit(read_captions(urls))
        for workers in args.workers:
            n, t = timed(pipeline_read, urls, tokenizer, args.batch_size, n_raw, workers)
            rows.append((f"training pipeline, {workers} workers", n, t))
    for name, n, t in rows:
        print(f"{name:<32} {n / t:8.0f} samples/s ({n} in {t:.2f}s), ratio to the bare read "
              f"{(n / t) / (n_raw / t_raw):.3f}")

if __name__ == "__main__":
    main()
