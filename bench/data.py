"""Training data throughput: mmgoal's pipeline against open_clip's and a hand-written loop.

    python bench/data.py                                   # 4000 synthetic 64 px PNGs
    python bench/data.py --format jpg --image-size 224     # JPEGs at CLIP's size
    python bench/data.py --shards 'data/web/train-{000000..000007}.tar'

The same shards (an image, a ``txt`` caption and a ``json`` of metadata per
sample, the img2dataset layout that open_clip reads; written fresh from the
synthetic benchmark's scenes unless ``--shards`` is given), the same decoding
(image bytes -> PIL RGB), the same image transform (mmgoal's default: resize,
to tensor, normalise), the same tokenizer (CLIP's BPE, 77 ids), the same batch
size and the same shuffle buffer (``--shuffle-buffer`` samples per reader, half
of them read before the first comes out), through:

- (a) mmgoal: ``ShardDataset`` with ``caption_key: txt``, built from its
  config, in the DataLoader the trainer makes (``batch_size=None``);
- (b) open_clip: ``open_clip_train.data.get_wds_dataset``, the function
  ``open_clip_train.main`` trains from, fed the arguments it reads, with its
  own ``WebLoader`` (its shard reader is written for webdataset 0.2; under
  webdataset 1.x it is handed the tar expander without 1.x's end-of-shard
  marker, as 0.2 read tars, and is otherwise unchanged);
- (c) a hand-written loop: tar member -> PIL -> transform, captions tokenized
  per batch, ``torch.stack``; its workers split the shards.

Throughput is measured in the steady state, over ``--batches`` batches after
the first ones (while the shuffle buffers fill, a batch costs more tar reads
than it holds); the shards hold enough samples that open_clip's epoch does not
end inside the timed batches. Each is measured at each ``--workers`` count,
the best of ``--repeats`` interleaved runs kept. Prints samples/s, the time to
the first batches (worker start-up and buffer fill) and the ratios (a)/(b)
and (a)/(c).
"""

from __future__ import annotations

import argparse
import functools
import io
import itertools
import math
import tarfile
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import open_clip
import open_clip_train.data as open_clip_data
import torch
from PIL import Image
from webdataset.tariterators import tar_file_expander

from mmgoal.data.pipeline import expand_shards
from mmgoal.data.shards import ShardWriter
from mmgoal.data.synthetic import iter_scenes, scene_sample
from mmgoal.data.tokenizers import OpenCLIPTokenizer
from mmgoal.data.transforms import build_transforms
from mmgoal.registry import DATASETS

TOKENIZER = "ViT-B-32"  # the CLIP BPE tokenizer, 77 ids per caption


def write_shards(out_dir: str, samples: int, shard_size: int, image_size: int,
                 image_format: str) -> str:
    """Synthetic scenes as img2dataset-style samples (image, txt, json); the shard pattern."""
    with ShardWriter(out_dir, "train", max_count=shard_size) as writer:
        for scene in iter_scenes("train", samples, image_size=image_size):
            sample = scene_sample(scene, "train")
            if image_format == "jpg":
                buffer = io.BytesIO()
                scene.image.save(buffer, format="JPEG", quality=90)
                del sample["png"]
                sample["jpg"] = buffer.getvalue()
            sample["txt"] = scene.captions[0].encode()
            writer.write(sample)
    return f"{out_dir}/train-{{000000..{len(writer.paths) - 1:06d}}}.tar"


def mmgoal_loader(pattern: str, batch_size: int, workers: int, shuffle_buffer: int, transform,
                  tokenizer):
    dataset = DATASETS.build({"type": "ShardDataset", "shards": pattern, "caption_key": "txt",
                              "shuffle_buffer": shuffle_buffer},
                             batch_size=batch_size, tokenizer=tokenizer, transform=transform)
    return torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=workers,
                                       persistent_workers=False)


def open_clip_loader(pattern: str, samples: int, batch_size: int, workers: int,
                     shuffle_buffer: int, transform, tokenizer):
    # open_clip reads its buffer sizes from these module constants; mmgoal fills half first
    open_clip_data._SAMPLE_SHUFFLE_SIZE = shuffle_buffer
    open_clip_data._SAMPLE_SHUFFLE_INITIAL = shuffle_buffer // 2
    # webdataset 1.x ends each shard with an empty "end of file" sample, which open_clip's
    # group_by_keys_nothrow (written for webdataset 0.2) cannot read: open it without one,
    # as webdataset 0.2 did
    open_clip_data.tar_file_expander = functools.partial(tar_file_expander, eof_value=None)
    args = SimpleNamespace(train_data=pattern, train_num_samples=samples, dataset_resampled=False,
                           train_data_upsampling_factors=None, seed=0, batch_size=batch_size,
                           workers=workers, world_size=1)
    return open_clip_data.get_wds_dataset(args, transform, is_train=True, floor=True,
                                          tokenizer=tokenizer).dataloader


class HandWritten(torch.utils.data.IterableDataset):
    """tar -> PIL -> transform -> stack: what one writes without a data library."""

    def __init__(self, urls: list[str], batch_size: int, transform, tokenizer) -> None:
        super().__init__()
        self.urls, self.batch_size = urls, batch_size
        self.transform, self.tokenizer = transform, tokenizer

    def samples(self):
        info = torch.utils.data.get_worker_info()
        urls = self.urls if info is None else self.urls[info.id::info.num_workers]
        for url in itertools.cycle(urls):
            with tarfile.open(url) as archive:
                sample: dict = {}
                for member in archive:
                    stem, ext = member.name.split(".", 1)
                    if sample and sample["key"] != stem:
                        yield sample
                        sample = {}
                    sample["key"] = stem
                    sample[ext] = archive.extractfile(member).read()
                if sample:
                    yield sample

    def __iter__(self):
        samples = self.samples()
        while True:
            chunk = list(itertools.islice(samples, self.batch_size))
            images = [self.transform(Image.open(io.BytesIO(s.get("jpg") or s["png"]))
                                     .convert("RGB")) for s in chunk]
            yield torch.stack(images), self.tokenizer([s["txt"].decode() for s in chunk])


def hand_loader(pattern: str, batch_size: int, workers: int, transform, tokenizer):
    return torch.utils.data.DataLoader(HandWritten(expand_shards(pattern), batch_size, transform,
                                                   tokenizer),
                                       batch_size=None, num_workers=workers)


def batch_size_of(batch) -> int:
    return len(batch["captions"]) if isinstance(batch, dict) else len(batch[0])


def timed(make_loader, warm: int, batches: int) -> tuple[int, float, float]:
    """Of a fresh loader: seconds to its first ``warm`` batches (worker start-up, shuffle
    buffer fill), then samples read and seconds taken for the ``batches`` after them."""
    start = time.perf_counter()
    loader = iter(make_loader())
    for _ in range(warm):
        next(loader)
    started = time.perf_counter()
    count = sum(batch_size_of(next(loader)) for _ in range(batches))
    return count, time.perf_counter() - started, started - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shards", help="img2dataset-style shards to read (image, txt), "
                                         "--samples of them at least; default: fresh synthetic")
    parser.add_argument("--samples", type=int, default=6000,
                        help="synthetic samples to write (open_clip's train_num_samples)")
    parser.add_argument("--shard-size", type=int, default=500)
    parser.add_argument("--image-size", type=int, default=64, help="of the stored images and "
                        "of the transform's output")
    parser.add_argument("--format", choices=["png", "jpg"], default="png")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--shuffle-buffer", type=int, default=1000,
                        help="samples in each reader's shuffle buffer (half before the first)")
    parser.add_argument("--batches", type=int, default=16, help="batches timed")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    transform = build_transforms(None, args.image_size)
    mmgoal_tokenizer = OpenCLIPTokenizer(TOKENIZER)
    clip_tokenizer = open_clip.get_tokenizer(TOKENIZER)
    with tempfile.TemporaryDirectory() as tmp:
        pattern = args.shards or write_shards(tmp, args.samples, args.shard_size,
                                              args.image_size, args.format)
        for url in expand_shards(pattern):  # warm the page cache for every reader
            Path(url).read_bytes()
        print(f"{len(expand_shards(pattern))} shards, {args.samples} samples "
              f"({args.format if not args.shards else pattern}), {args.image_size} px, batch "
              f"{args.batch_size}, shuffle buffer {args.shuffle_buffer}, torch threads "
              f"{torch.get_num_threads()}")
        for workers in args.workers:
            readers = max(1, workers)
            # until every reader's buffer is full, a batch costs more reads than it holds
            warm = readers * (math.ceil(args.shuffle_buffer / 2 / args.batch_size) + 1)
            batches = math.ceil(args.batches / readers) * readers
            needed = readers * args.shuffle_buffer + (warm + batches) * args.batch_size
            if needed > args.samples:
                raise SystemExit(f"{workers} workers read about {needed} samples; give "
                                 f"--samples {needed} or more, or fewer --batches")
            loaders = {
                "mmgoal": functools.partial(mmgoal_loader, pattern, args.batch_size, workers,
                                            args.shuffle_buffer, transform, mmgoal_tokenizer),
                "open_clip": functools.partial(open_clip_loader, pattern, args.samples,
                                               args.batch_size, workers, args.shuffle_buffer,
                                               transform, clip_tokenizer),
                "hand-written": functools.partial(hand_loader, pattern, args.batch_size,
                                                  workers, transform, clip_tokenizer),
            }
            best: dict[str, tuple[int, float, float]] = {}
            for _ in range(args.repeats):
                for name, make in loaders.items():
                    result = timed(make, warm, batches)
                    if name not in best or result[1] < best[name][1]:
                        best[name] = result
            rate = {name: count / seconds for name, (count, seconds, _) in best.items()}
            for name, (count, seconds, first) in best.items():
                print(f"data {workers} workers, {name:<13} {rate[name]:8.0f} samples/s "
                      f"({count} in {seconds:.2f}s after {warm} batches in {first:.2f}s)")
            print(f"data {workers} workers: ratio mmgoal / open_clip "
                  f"{rate['mmgoal'] / rate['open_clip']:.3f}, mmgoal / hand-written "
                  f"{rate['mmgoal'] / rate['hand-written']:.3f}")


if __name__ == "__main__":
    main()
