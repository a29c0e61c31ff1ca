"""The ``mmgoal`` command: one entry point for every tool, ``mmgoal COMMAND [ARGS]``.

    mmgoal --help                     # the commands, a line each
    mmgoal train quickstart           # a shipped config by name, or any config file
    mmgoal train --help               # one command's options
    python -m mmgoal train quickstart
    torchrun --nproc_per_node 2 -m mmgoal train configs/quickstart.yaml
    deepspeed --num_gpus 2 --module mmgoal train configs/quickstart.yaml --deepspeed

Each command is a module of :mod:`mmgoal.cli` with a ``main(argv) -> int``; the
repository's ``tools/*.py`` call the same ``main`` (docs/getting_started.md). The
command list reads each module's first line with ``ast``, without importing it, and a
command's module imports torch only once its arguments are read: ``mmgoal --help``,
``COMMAND --help``, ``--version`` and ``configs`` answer without it (bench/startup.py).
"""

from __future__ import annotations

import ast
import difflib
import importlib
import importlib.util
import os
import re
import sys

import mmgoal
from mmgoal.cli.arguments import print_error, summary

# command -> its module of mmgoal.cli, in the order --help lists them
COMMANDS = {
    "train": "train",
    "eval": "evaluate",
    "export": "export",
    "search": "search",
    "make-shards": "make_shards",
    "make-synthetic": "make_synthetic",
    "inspect-shards": "inspect_shards",
    "sweep": "sweep",
    "compare-runs": "compare_runs",
    "score-stats": "score_stats",
    "plot-curves": "plot_curves",
    "plot-weights": "plot_weights",
    "plot-attention": "plot_attention",
    "wise-ft": "wise_ft",
    "configs": "configs",
}
# what the deepspeed launcher puts before the command (`python -m mmgoal --local_rank=0 train`)
LOCAL_RANK = re.compile(r"--local[_-]rank(?:=(\d+))?$")


def description(command: str) -> str:
    """The command's one line: its module's docstring, read without importing the module."""
    spec = importlib.util.find_spec(f"mmgoal.cli.{COMMANDS[command]}")
    with open(spec.origin, encoding="utf-8") as source:
        return summary(ast.get_docstring(ast.parse(source.read())) or "")


def usage() -> str:
    width = max(map(len, COMMANDS)) + 2
    lines = ["usage: mmgoal [--version] COMMAND [ARGS ...]   (mmgoal COMMAND --help: its "
             "options)", "",
             f"mmgoal {mmgoal.__version__}: image-text matching with GOAL gradient objectives, "
             f"from YAML configs.", "", "commands:"]
    lines += [f"  {command:<{width}}{description(command)}" for command in COMMANDS]
    lines += ["", "A config is a file or the name of one shipped with mmgoal (mmgoal configs).",
              "Several processes: torchrun --nproc_per_node N -m mmgoal train CONFIG, or",
              "deepspeed --num_gpus N --module mmgoal train CONFIG --deepspeed."]
    return "\n".join(lines)


def take_local_rank(argv: list[str]) -> list[str]:
    """``argv`` without the ``--local_rank=N`` (or ``--local_rank N``) that the deepspeed
    launcher passes before the command; LOCAL_RANK, which it also sets, says the same."""
    rest = list(argv)
    while rest and (match := LOCAL_RANK.match(rest[0])):
        value = match.group(1)
        if value is None and len(rest) > 1 and rest[1].isdigit():
            value = rest.pop(1)
        if value is not None:
            os.environ.setdefault("LOCAL_RANK", value)
        rest.pop(0)
    return rest


def main(argv: list[str] | None = None) -> int:
    argv = take_local_rank(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"mmgoal {mmgoal.__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        close = difflib.get_close_matches(command, list(COMMANDS), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        return print_error(f"mmgoal has no command {command!r}{hint}; mmgoal --help lists them")
    tool = importlib.import_module(f"mmgoal.cli.{COMMANDS[command]}")
    # argparse names a program after sys.argv[0]: usage lines then read `mmgoal train ...`
    sys.argv[0] = f"mmgoal {command}"
    try:
        return int(tool.main(rest) or 0)
    except BrokenPipeError:  # `mmgoal configs | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no flush error
        return 141  # a shell's status for SIGPIPE
