"""List the configs shipped with mmgoal, or copy one out as a starting point of your own.

    mmgoal configs                    # every shipped config, with its first comment line
    mmgoal configs clip               # those whose name holds "clip" (or a glob: 'scan/*_f30k')
    mmgoal configs --copy quickstart my_quickstart.yaml
    mmgoal train my_quickstart.yaml

A shipped config is found by name wherever you run (``mmgoal train quickstart``);
a file of that name in the working directory wins. ``--copy`` writes the config
with its ``_base_`` files merged in, so the copy stands alone (docs/configs.md).
"""

from __future__ import annotations

import re
import shutil
import textwrap
from pathlib import Path

import mmgoal
from mmgoal.cli.arguments import INPUT_ERRORS, print_error, tool_parser
from mmgoal.config import (
    SHIPPED_CONFIGS,
    config_text,
    load_config,
    shipped_config_name,
    shipped_configs,
)
from mmgoal.files import write_text


def description(path: Path) -> str:
    """The config's description: the first sentence of its leading comment, whole (up to
    a blank comment line or an indented command); ``""`` without one."""
    words = []
    for line in leading_comments(path):
        text = line[1:]
        if not text.strip() or text.startswith("   "):  # a paragraph's end, a command
            break
        words.append(text.strip())
    paragraph = " ".join(words)
    sentence = re.match(r"(.+?[.!?])(\s|$)", paragraph)
    return sentence.group(1) if sentence else paragraph


def leading_comments(path: Path) -> list[str]:
    """The comment lines at the top of a config."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line)
    return lines


def matching(pattern: str | None) -> dict[str, Path]:
    """The shipped configs a ``PATTERN`` names: a glob, else a part of the name."""
    if pattern is None:
        return shipped_configs()
    return shipped_configs(pattern if any(c in pattern for c in "*?[") else f"*{pattern}*")


def copy_config(name: str, dest: str | Path, force: bool = False) -> Path:
    """Write the shipped config ``name`` with its bases merged to ``dest`` (a ``.yaml`` or
    ``.yml`` file, or a folder, made if need be, that gets ``<name's file name>``); the file
    written.

    Raises:
        FileNotFoundError: no shipped config of that name.
        ValueError: ``dest`` exists and ``force`` is not given.
    """
    shipped = shipped_configs()
    key = shipped_config_name(name)
    if key not in shipped:
        raise FileNotFoundError(f"mmgoal ships no config named {name!r}; `mmgoal configs` "
                                f"lists them")
    source = shipped[key]
    folder = Path(dest).is_dir() or str(dest).endswith("/") or \
        Path(dest).suffix not in (".yaml", ".yml")
    out = Path(dest) / source.name if folder else Path(dest)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists() and not force:
        raise ValueError(f"{out} exists; give another file name, or --force to overwrite it")
    header = [*leading_comments(source),
              f"# Copied from mmgoal {mmgoal.__version__}'s configs/{key}.yaml by `mmgoal configs "
              f"--copy`,", "# its _base_ files merged in: it stands alone."]
    write_text(out, "\n".join(header) + "\n" + config_text(load_config(source)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = tool_parser(__doc__)
    parser.add_argument("pattern", nargs="?", help="list only the configs whose name holds "
                                                   "this (or matches it, as a glob)")
    parser.add_argument("--copy", nargs=2, metavar=("NAME", "DEST"),
                        help="write the shipped config NAME, its _base_ files merged in, to "
                             "the file DEST (.yaml) or into the folder DEST")
    parser.add_argument("--force", action="store_true", help="with --copy: overwrite DEST")
    args = parser.parse_args(argv)
    if args.copy:
        try:
            out = copy_config(args.copy[0], args.copy[1], args.force)
        except INPUT_ERRORS as error:
            return print_error(error)
        print(f"{out}: configs/{shipped_config_name(args.copy[0])}.yaml with its bases merged; "
              f"train it with: mmgoal train {out}")
        return 0
    found = matching(args.pattern)
    if not found:
        return print_error(f"no shipped config's name matches {args.pattern!r}; `mmgoal "
                           f"configs` lists them all")
    width = max(map(len, found)) + 2
    columns = max(shutil.get_terminal_size((120, 24)).columns, width + 40)
    for name, path in found.items():  # whole sentences, wrapped under their column
        print(textwrap.fill(description(path), columns, initial_indent=f"{name:<{width}}",
                            subsequent_indent=" " * width))
    print(f"\n{len(found)} config(s) in {SHIPPED_CONFIGS}; `mmgoal train NAME` trains one, "
          f"`mmgoal configs --copy NAME FILE` copies one out")
    return 0
