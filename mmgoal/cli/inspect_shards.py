"""Inspect and validate shards: counts, caption and image statistics, keys, problems.

    mmgoal inspect-shards 'data/coco/*.tar'
    mmgoal inspect-shards 'laion/{00000..00099}.tar' --caption-key txt --json report.json

Every sample of every shard is read: images decoded whole, JSON parsed,
``regions.npy``/``boxes.npy`` loaded. Reported per shard: unreadable images or
members, samples without captions or without an image/regions, image ids that
appear twice (in the shard or in an earlier one), samples larger than
``--max-sample-bytes`` (not read), a damaged tar (cut short, a zeroed header, data
after its end: mmgoal/data/tars.py), a shard without samples. Shards may be local
files, URLs or ``pipe:`` commands, as in a config. Exits 1 when anything is wrong, 2
when the arguments are, 0 otherwise.
"""

from __future__ import annotations

import io
import json
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from mmgoal import strict_json
from mmgoal.cli.arguments import INPUT_ERRORS, print_error, tool_parser
from mmgoal.console import progress_bar
from mmgoal.data.images import ImageDecodeError, decode_image
from mmgoal.data.remote import expand_shards, iter_samples
from mmgoal.data.tars import IMAGE_EXTENSIONS, MAX_SAMPLE_BYTES, TarDamageError
from mmgoal.files import write_text


def samples_of(url: str, problems: list[str], max_sample_bytes: int
               ) -> Iterator[tuple[str, dict[str, bytes]]]:
    """The shard's samples (key, members) one at a time (a shard can be gigabytes); what
    the reader met (an oversized sample, a damaged tar) is appended to ``problems``."""
    def met(error: Exception) -> None:
        if isinstance(error, TarDamageError):
            problems.append(f"damaged tar after {error.samples} samples ({error.reason})")
        else:
            problems.append(str(error))

    for sample in iter_samples(url, met, max_sample_bytes=max_sample_bytes):
        key = sample.pop("__key__")
        del sample["__url__"]
        yield key, sample


def check_sample(key: str, members: dict[str, bytes], caption_key: str | None,
                 stats: dict) -> tuple[object, list[str]]:
    """Add one sample to ``stats``; return (its image id, its problems)."""
    problems: list[str] = []
    meta: dict = {}
    if "json" in members:
        try:
            meta = json.loads(members["json"])
        except (ValueError, UnicodeDecodeError) as error:
            problems.append(f"{key}: unreadable json ({error})")
    if caption_key is not None:
        captions = ([members[caption_key].decode("utf-8", errors="replace").strip()]
                    if caption_key in members else [])
    else:
        captions = meta.get("captions") or []
    if not captions:
        problems.append(f"{key}: no captions ({'.' + caption_key if caption_key else 'json'})")
    stats["captions"] += len(captions)
    stats["caption_words"].extend(len(c.split()) for c in captions)
    image_ext = next((e for e in IMAGE_EXTENSIONS if e in members), None)
    if image_ext is not None:
        try:
            image = decode_image(members[image_ext], key)
            stats["widths"].append(image.size[0])
            stats["heights"].append(image.size[1])
        except ImageDecodeError as error:
            problems.append(str(error))
    for name in ("regions.npy", "boxes.npy"):
        if name in members:
            try:
                np.load(io.BytesIO(members[name]), allow_pickle=False)
            except (ValueError, OSError) as error:
                problems.append(f"{key}: unreadable {name} ({error})")
    if image_ext is None and "regions.npy" not in members:
        problems.append(f"{key}: no image ({', '.join(IMAGE_EXTENSIONS)}) and no regions.npy")
    stats["keys"].update(members.keys())
    return meta.get("image_id", key), problems


def inspect(urls: list[str], caption_key: str | None = None, progress: bool = True,
            max_sample_bytes: int = MAX_SAMPLE_BYTES) -> dict:
    """Statistics and problems of ``urls`` (see the module docstring)."""
    stats = {"samples": 0, "captions": 0, "caption_words": [], "widths": [], "heights": [],
             "keys": Counter()}
    shards = []
    first_shard: dict[str, str] = {}  # image id -> the shard it first appeared in
    for url in progress_bar(urls, unit="shard", show=progress):
        read: list[str] = []  # what the reader met: oversized samples, damage
        problems: list[str] = []
        ids: Counter = Counter()
        for key, members in samples_of(url, read, max_sample_bytes):
            image_id, found = check_sample(key, members, caption_key, stats)
            problems.extend(found)
            ids[str(image_id)] += 1
        count = sum(ids.values())
        problems.extend(read)
        problems.extend(f"image id {i!r} appears {n} times" for i, n in ids.items() if n > 1)
        problems.extend(f"image id {i!r} is also in {first_shard[i]}" for i in ids
                        if i in first_shard)
        for image_id in ids:
            first_shard.setdefault(image_id, url)
        if not count and not read:
            problems.append("no samples")
        stats["samples"] += count
        shards.append({"shard": url, "samples": count, "problems": problems})
    return {"shards": shards, "samples": stats["samples"], "captions": stats["captions"],
            "caption_words": describe(stats["caption_words"]),
            "image_width": describe(stats["widths"]), "image_height": describe(stats["heights"]),
            "keys": dict(sorted(stats["keys"].items())),
            "problems": sum(len(s["problems"]) for s in shards)}


def describe(values: list[int]) -> dict:
    if not values:
        return {}
    array = np.asarray(values)
    return {"min": int(array.min()), "median": float(np.median(array)),
            "mean": round(float(array.mean()), 2), "max": int(array.max())}


def format_report(report: dict, max_problems: int) -> str:
    lines = [f"{len(report['shards'])} shards, {report['samples']} samples, "
             f"{report['captions']} captions",
             f"caption words: {report['caption_words']}",
             f"image width: {report['image_width']}; height: {report['image_height']}",
             "members: " + ", ".join(f".{k} x{n}" for k, n in report["keys"].items())]
    shown = 0
    for shard in report["shards"]:
        for problem in shard["problems"]:
            if shown < max_problems:
                lines.append(f"PROBLEM {shard['shard']}: {problem}")
            shown += 1
    if shown > max_problems:
        lines.append(f"... and {shown - max_problems} more (see --json)")
    lines.append(f"{report['problems']} problem(s)" if report["problems"] else "no problems")
    return "\n".join(lines)


def shard_urls(patterns: list[str]) -> list[str]:
    """The shards of ``patterns``; a folder is refused with the pattern that was meant."""
    for pattern in patterns:
        if Path(pattern).is_dir():
            raise ValueError(f"{pattern} is a folder; give its shards, e.g. "
                             f"'{Path(pattern) / '*.tar'}'")
    return expand_shards(patterns)


def main(argv: list[str] | None = None) -> int:
    parser = tool_parser(__doc__)
    parser.add_argument("shards", nargs="+", help="shard files, globs or brace patterns")
    parser.add_argument("--caption-key", help="captions from this member (txt), not the JSON")
    parser.add_argument("--json", type=Path, help="write the whole report here")
    parser.add_argument("--max-problems", type=int, default=20, help="problems printed")
    parser.add_argument("--max-sample-bytes", type=int, default=MAX_SAMPLE_BYTES,
                        help="a sample whose members hold more is a problem, and is not read "
                             "(data.max_sample_bytes; default %(default)s)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    try:
        urls = shard_urls(args.shards)
        if args.json is not None and args.json.is_dir():
            raise ValueError(f"--json {args.json} is a folder; give a file, e.g. "
                             f"{args.json / 'report.json'}")
        if args.json is not None and not args.json.parent.is_dir():
            raise ValueError(f"--json {args.json}: the folder {args.json.parent} does not "
                             f"exist")
    except INPUT_ERRORS as error:  # braceexpand: ValueError
        return print_error(error)
    report = inspect(urls, args.caption_key, progress=not args.no_progress,
                     max_sample_bytes=args.max_sample_bytes)
    print(format_report(report, args.max_problems))
    if args.json:
        try:
            write_text(args.json, strict_json.dumps(report, indent=2))
        except OSError as error:
            return print_error(f"cannot write --json {args.json} ({error.strerror})")
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
