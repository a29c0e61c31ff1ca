"""Convert a data set into mmgoal shards (docs/data.md).

    mmgoal make-shards karpathy --json dataset_coco.json --image-root /data/coco \\
        --out data/coco [--max-size 640] [--workers 8]
    mmgoal make-shards precomputed --data-dir /data/scan/f30k_precomp \\
        --out data/f30k_precomp
    mmgoal make-shards entities --shards 'data/f30k/*.tar' \\
        --entities-root /data/flickr30k_entities --out data/f30k_entities
    mmgoal make-shards csv --train train.csv --val val.csv --out data/mine \\
        [--img-key filepath] [--caption-key title] [--separator ,]
    mmgoal make-shards folder --train photos/train --test photos/test --out data/photos
    mmgoal make-shards hf --dataset /data/my_saved_dataset --image-key image \\
        --caption-key caption --out data/mine_hf
    mmgoal make-shards karpathy ... --out data/coco --resume   # after an interruption

``--resume`` requires the options of the first run (recorded in the --out folder's
summary.json).

Every source option after SOURCE is ``--name value`` for the source's constructor
argument ``name`` (dashes for underscores); ``--custom-imports my.module`` makes a
source of your own (registered in ``SHARD_SOURCES``) available.
"""

from __future__ import annotations

import argparse
import inspect
import logging
import re
import sys
import typing
from pathlib import Path

from mmgoal.cli.arguments import INPUT_ERRORS, print_error, tool_parser
from mmgoal.data.conversion import convert, format_summary
from mmgoal.registry import SHARD_SOURCES, import_custom_modules


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, dict]:
    argv = sys.argv[1:] if argv is None else list(argv)
    named = [token for token in argv if token in SHARD_SOURCES.names()]
    if named and {"-h", "--help"} & set(argv):  # make-shards SOURCE --help: its own options
        source_parser(named[0]).print_help()
        raise SystemExit(0)
    parser = tool_parser(__doc__, epilog=source_options_help(),
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="a registered shard source: "
                                       + ", ".join(SHARD_SOURCES.names()))
    parser.add_argument("--out", type=Path, required=True, help="folder of the shards")
    parser.add_argument("--shard-size", type=int, default=1000, help="items per shard")
    parser.add_argument("--workers", type=int, default=1, help="shards written in parallel")
    parser.add_argument("--resume", action="store_true",
                        help="finish an interrupted conversion (finished shards are kept)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--custom-imports", nargs="+", default=[], metavar="MODULE")
    args, rest = parser.parse_known_args(argv)
    import_custom_modules(args.custom_imports)
    return args, source_options(args.source, rest)


def source_options_help() -> str:
    """The options of every registered source, one source a line (optional ones bracketed)."""
    lines = ["source options (after SOURCE; those in brackets have defaults):"]
    for source in SHARD_SOURCES.names():
        required = SHARD_SOURCES.required(source)
        options = [f"--{p.replace('_', '-')}" if p in required else f"[--{p.replace('_', '-')}]"
                   for p in inspect.signature(SHARD_SOURCES.get(source)).parameters]
        lines.append(f"  {source}: {' '.join(options)}")
    return "\n".join(lines)


def documented(target: type) -> dict[str, str]:
    """Each parameter's description from the ``Args:`` block of ``target``'s docstring
    (``a, b: text`` describes both)."""
    doc = inspect.getdoc(target) or ""
    if "Args:" not in doc:
        return {}
    found: dict[str, str] = {}
    names: list[str] = []
    for line in doc.split("Args:", 1)[1].splitlines():
        entry = re.match(r"^    ([\w, ]+):\s*(.*)$", line)
        if entry:
            names = [name.strip() for name in entry.group(1).split(",")]
            for name in names:
                found[name] = entry.group(2)
        elif line.startswith("        ") and names:  # the entry goes on
            for name in names:
                found[name] += " " + line.strip()
        elif line.strip():
            break
    return {name: text.replace("``", "") for name, text in found.items()}


def source_parser(source: str) -> argparse.ArgumentParser:
    """The help of one source (``make-shards SOURCE --help``): its options, what each is
    for, and its defaults."""
    target = SHARD_SOURCES.get(source)
    doc = (inspect.getdoc(target) or "").split("\n\n", 1)[0]
    parser = argparse.ArgumentParser(
        prog=f"mmgoal make-shards {source}", description=doc.replace("``", ""),
        usage=f"mmgoal make-shards {source} --out OUT [--shard-size N] [--workers N] "
              f"[--resume] [{source} options]",
        epilog="the common options: mmgoal make-shards --help")
    group = parser.add_argument_group(f"{source} options")
    about = documented(target)
    required = SHARD_SOURCES.required(source)
    for name, parameter in inspect.signature(target).parameters.items():
        flag = f"--{name.replace('_', '-')}"
        text = about.get(name) or (f"the {name} split's file or folder"
                                   if name in ("train", "val", "test") else "")
        if name in required:
            text += " (required)"
        elif parameter.default not in (None, False, inspect.Parameter.empty):
            text += f" (default: {parameter.default!r})"
        group.add_argument(flag, help=text.strip() or None,
                           **({"action": "store_true"} if parameter.default is False else {}))
    return parser


def source_options(source: str, rest: list[str]) -> dict:
    """``--name value`` pairs for the constructor of ``source``, typed by its annotations.

    Raises:
        ValueError: an option the source does not take, or one without a value.
    """
    target = SHARD_SOURCES.get(source)
    parameters = inspect.signature(target).parameters
    hints = typing.get_type_hints(target.__init__)
    options: dict = {}
    it = iter(rest)
    for token in it:
        name = token.lstrip("-").replace("-", "_")
        if not token.startswith("--") or name not in parameters:
            known = ", ".join("--" + p.replace("_", "-") for p in parameters)
            raise ValueError(f"source {source!r} takes no option {token!r}; it takes: {known}")
        kind = hints.get(name)
        if kind is bool:  # a switch: its presence says yes
            options[name] = True
            continue
        value = next(it, None)
        if value is None or value.startswith("--"):
            raise ValueError(f"option {token} needs a value")
        options[name] = (int(value) if kind in (int, int | None) else
                         float(value) if kind in (float, float | None) else value)
    return options


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        args, options = parse_args(argv)
        source = SHARD_SOURCES.build({"type": args.source, **options})
        summary = convert(source, args.out, shard_size=args.shard_size, workers=args.workers,
                          resume=args.resume, progress=not args.no_progress,
                          options={"source": args.source, **options})
    except (*INPUT_ERRORS, FileExistsError, KeyError, TypeError) as error:
        return print_error(error)
    print(format_summary(summary))
    print(f"shards and summary.json in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
