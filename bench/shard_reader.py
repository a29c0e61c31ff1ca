"""Shard streaming throughput against a raw tar read of the same shards.

    python bench/shard_reader.py [--shards 'data/synthetic/train-*.tar']

Baseline: ``tarfile`` reading every member's bytes (no decoding). Measured: the
training pipeline (tar -> samples -> shuffle -> PNG decode -> transform ->
tokenize -> batch) in this process. Prints samples/s of both and their ratio;
the gap is the price of decoding and batching.
"""

from __future__ import annotations

import argparse
import itertools
import tarfile
import tempfile
import time

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


def pipeline_read(urls: list[str], batch_size: int, samples: int) -> int:
    """One epoch of the training stream (which itself never ends): ``samples`` // batch."""
    tokenizer = WordTokenizer().fit(read_captions(urls))
    dataset = ShardDataset(urls, batch_size, tokenizer, build_transforms(None, 64))
    return sum(len(batch["captions"])
               for batch in itertools.islice(dataset, samples // batch_size))


def timed(fn, *args) -> tuple[int, float]:
    start = time.perf_counter()
    count = fn(*args)
    return count, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shards", help="shards to read (default: 2000 fresh synthetic images)")
    parser.add_argument("--batch-size", type=int, default=128)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.shards is None:
            write_benchmark(tmp, {"train": 2000}, shard_size=500, progress=False)
            args.shards = f"{tmp}/train-*.tar"
        urls = expand_shards(args.shards)
        raw_tar_read(urls)  # warm the page cache for both readers
        n_raw, t_raw = timed(raw_tar_read, urls)
        n_pipe, t_pipe = timed(pipeline_read, urls, args.batch_size, n_raw)
    print(f"raw tar read (baseline): {n_raw / t_raw:10.0f} samples/s ({n_raw} in {t_raw:.2f}s)")
    print(f"training pipeline:       {n_pipe / t_pipe:10.0f} samples/s ({n_pipe} in {t_pipe:.2f}s)")
    print(f"ratio pipeline / raw tar: {(n_pipe / t_pipe) / (n_raw / t_raw):.3f}")


if __name__ == "__main__":
    main()
