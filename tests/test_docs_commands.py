"""The commands, config paths and links of README.md and docs/ match the repository.

Nothing is trained or converted. Every command line of a fenced code block that
runs ``mmgoal <command>`` (also under a launcher, ``-m mmgoal``/``--module mmgoal``)
or the repository's ``tools/<name>.py`` is checked against that command's own
``--help``: the command exists and takes every ``--flag`` the line passes; each
tools/ shim takes exactly the options of its command. The ``--cfg-options`` of
``train``/``eval``/``sweep`` commands must load with their config
(``load_run_config``). Every ``configs/...yaml`` the pages name exists, and so
does every ``docs/...md`` they name and every relative link. Placeholders
(``CONFIG``, ``CKPT``, ``<name>``, ``$c``, ``...``) are skipped.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from mmgoal.cli.main import COMMANDS
from mmgoal.config import SHIPPED_CONFIGS, find_config
from mmgoal.registry import OBJECTIVES
from mmgoal.runs.schema import load_run_config

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^\s*```")
# `mmgoal train ...`; not Python's `from mmgoal import X`
TOOL = re.compile(r"(?:^|(?<=\s))(?<!from )(?:\S*/)?(tools/\w+\.py|mmgoal [a-z][a-z-]*)(?=\s|$)")
COMMAND_END = {"&&", "||", ";", "|", ">", ">>", "2>&1"}
CONFIG_PATH = re.compile(r"(?<![\w./-])(?:\.\./)*(configs/[\w{},./-]+?\.yaml)")
DOC_PATH = re.compile(r"(?<![\w./-])(docs/[\w./-]+?\.md)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
CONFIG_TOOLS = {"train", "eval", "sweep"}
# Files the tools write, named in the docs as where output goes.
WRITTEN_BY_TOOLS = {"docs/results/gpu.md"}  # bench/gpu_check.py


def shim_commands() -> dict[str, str]:
    """``{"tools/finetune.py": "train", ...}``: the mmgoal command each tools/ shim runs."""
    modules = {module: command for command, module in COMMANDS.items()}
    shims = {}
    for path in sorted((ROOT / "tools").glob("*.py")):
        found = re.search(r"^from mmgoal\.cli\.(\w+) import main$", path.read_text(), re.M)
        if found:
            shims[f"tools/{path.name}"] = modules[found.group(1)]
    return shims


SHIMS = shim_commands()


@dataclass(frozen=True)
class Command:
    """One command of a fenced code block: where it is, the mmgoal command (``train``) or
    ``tools/<name>.py`` for a script of tools/ that is not a shim, its arguments."""

    where: str
    tool: str
    args: tuple[str, ...]

    def flags(self) -> list[str]:
        return [token.strip("[]").split("=")[0] for token in self.args
                if token.strip("[").startswith("--") and token.strip("[]") != "--"]

    def positionals(self) -> list[str]:
        """Arguments before the first flag (the config of finetune/evaluate/sweep first)."""
        return list(itertools.takewhile(lambda token: not token.startswith(("-", "[")),
                                        self.args))

    def cfg_options(self) -> list[str]:
        if "--cfg-options" not in self.args:
            return []
        after = self.args[self.args.index("--cfg-options") + 1:]
        return list(itertools.takewhile(lambda token: not token.startswith(("-", "[")), after))


def relative(page: Path) -> str:
    return str(page.relative_to(ROOT))


def is_placeholder(text: str) -> bool:
    return (any(mark in text for mark in ("<", "$", "*", "...")) or
            text.split("=")[0].isupper())


def fenced_lines(page: Path) -> list[tuple[int, str]]:
    """(line number, logical line) of the page's fenced code blocks, ``\\`` continuations
    joined onto the line where the command starts; a ```` ```text ```` block shows output
    (an error message), not commands, and is left out."""
    lines, inside, output, pending, start = [], False, False, "", 0
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if FENCE.match(line):
            inside = not inside
            output = inside and line.strip() == "```text"
            continue
        if not inside or output:
            continue
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        lines.append((start, pending + line))
        pending = ""
    return lines


def tokens(text: str) -> list[str]:
    """Shell words up to a comment or the end of the command (``&&``, ``|``, ...)."""
    text = re.split(r"(?:^|\s)#", text, maxsplit=1)[0]
    try:
        words = shlex.split(text)
    except ValueError:  # an unbalanced quote in a sketch of a command
        words = text.split()
    return list(itertools.takewhile(lambda word: word not in COMMAND_END, words))


def doc_commands() -> list[Command]:
    """Every command of the pages' code blocks, a shim's as its mmgoal command."""
    commands = []
    for page in PAGES:
        for number, line in fenced_lines(page):
            code = re.split(r"(?:^|\s)#", line, maxsplit=1)[0]
            for match in TOOL.finditer(code):
                name = match.group(1).removeprefix("mmgoal ")
                commands.append(Command(f"{relative(page)}:{number}", SHIMS.get(name, name),
                                        tuple(tokens(code[match.end():]))))
    return commands


HELP_SCRIPT = """
import contextlib, io, json, runpy, sys
from mmgoal.cli.main import main
helps = {}
for name in sys.argv[1:]:
    text = io.StringIO()
    try:
        with contextlib.redirect_stdout(text):
            if name.startswith("tools/"):
                sys.argv = [name, "--help"]
                runpy.run_path(name, run_name="__main__")
            else:
                main([name, "--help"])
    except SystemExit:
        pass
    except Exception as error:  # reported as the command's help, so the test names it
        text.write(f"--help failed: {error!r}")
    helps[name] = text.getvalue()
sys.__stdout__.write("\\n" + json.dumps(helps) + "\\n")
"""


@functools.cache
def helps() -> dict[str, str]:
    """The ``--help`` of every mmgoal command and of every script of tools/, in one process."""
    names = [*COMMANDS, *sorted(f"tools/{p.name}" for p in (ROOT / "tools").glob("*.py"))]
    result = subprocess.run([sys.executable, "-c", HELP_SCRIPT, *names], cwd=ROOT,
                            capture_output=True, text=True, timeout=180, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def options(help_text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--[A-Za-z][\w-]*", help_text))


def tool_options() -> dict[str, set[str]]:
    """The option strings of every command (and script of tools/), from ``--help``."""
    return {name: options(text) for name, text in helps().items()}


def test_each_tools_shim_is_its_command():
    """``python tools/finetune.py`` and ``mmgoal train`` are one command: the same options
    and description, only the program's name differs."""
    assert len(SHIMS) == len(COMMANDS) - 1  # all but mmgoal configs
    for shim, command in SHIMS.items():
        mine, its = helps()[shim], helps()[command]
        assert its.startswith(f"usage: mmgoal {command} ") and "--help failed" not in its, its
        assert mine.startswith(f"usage: {Path(shim).name} ")
        assert options(mine) == options(its) and len(options(its)) > 1, shim
        description = its.split("\n\n")[1]
        assert description in mine, shim


def test_the_docs_run_tools():
    names = {c.tool for c in doc_commands()}
    assert {"train", "eval", "make-shards", "configs"} <= names


def test_every_tool_a_command_runs_exists():
    missing = [f"{c.where}: {'mmgoal ' * (c.tool in COMMANDS)}{c.tool} does not exist"
               for c in doc_commands()
               if c.tool not in COMMANDS and not (ROOT / c.tool).is_file()]
    assert not missing, "\n".join(missing)


def test_every_flag_a_command_passes_is_one_the_tool_takes():
    options = tool_options()
    wrong = [f"{c.where}: {c.tool} takes no {flag} (it takes: "
             f"{', '.join(sorted(options[c.tool]))})"
             for c in doc_commands() if c.tool in options
             for flag in c.flags() if not is_placeholder(flag) and flag not in options[c.tool]]
    assert not wrong, "\n".join(wrong)


def named_config(text: str) -> Path | None:
    """The config a command's first argument names (a file or a shipped name), if any."""
    try:
        path = Path(text) if Path(text).is_absolute() else ROOT / text
        return path if path.is_file() else SHIPPED_CONFIGS / find_config(text).relative_to(
            SHIPPED_CONFIGS)
    except (FileNotFoundError, ValueError):
        return None


def config_commands() -> list[Command]:
    """Commands of train/eval/sweep that name a config (a file of the repository or a
    shipped name) and override it."""
    return [c for c in doc_commands() if c.tool in CONFIG_TOOLS and c.positionals()
            and c.cfg_options() and not is_placeholder(c.positionals()[0])
            and named_config(c.positionals()[0])]


def test_the_docs_override_configs():
    assert any(c.tool == "train" for c in config_commands())


@pytest.mark.parametrize("command", config_commands(), ids=lambda c: c.where)
def test_cfg_options_of_a_command_load(command):
    config = command.positionals()[0]
    overrides = [o for o in command.cfg_options() if not is_placeholder(o)]
    try:
        cfg = load_run_config(named_config(config), overrides)
    except (ValueError, FileNotFoundError, ImportError) as error:
        pytest.fail(f"{command.where}: {config} --cfg-options {' '.join(overrides)}: {error}")
    # GOAL's sig/sig_ms fine-tuning a CLIP: lam 0.5 collapses it (docs/models.md), auto not
    objective, pair = cfg["objective"], cfg["objective"].get("pair")
    if (cfg["model"]["type"] in ("OpenCLIP", "HFCLIP") and objective["type"] == "GoalObjective"
            and isinstance(pair, dict) and pair.get("type") in ("sig", "sig_ms")):
        assert pair.get("lam") == "auto", f"{command.where}: a CLIP fine-tuned with GOAL " \
                                          f"{pair['type']} and lam {pair.get('lam')}"


def expand_braces(text: str) -> list[str]:
    """``a_{x,y}.yaml`` -> ``a_x.yaml``, ``a_y.yaml`` (shell brace expansion)."""
    match = re.search(r"\{([^{}]*)\}", text)
    if not match:
        return [text]
    return [expanded for choice in match.group(1).split(",")
            for expanded in expand_braces(text[:match.start()] + choice + text[match.end():])]


def named_paths(pattern: re.Pattern) -> list[tuple[str, str]]:
    """(page:line, path) for every path the pages name, braces expanded."""
    named = []
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            named += [(f"{relative(page)}:{number}", path)
                      for found in pattern.findall(line) if not is_placeholder(found)
                      for path in expand_braces(found)]
    return named


def test_every_config_the_docs_name_exists():
    named = named_paths(CONFIG_PATH)
    assert len(named) > 20
    missing = [f"{where}: {path} does not exist" for where, path in named
               if not (ROOT / path).is_file()]
    assert not missing, "\n".join(missing)


def test_every_docs_page_the_docs_name_exists():
    missing = [f"{where}: {path} does not exist" for where, path in named_paths(DOC_PATH)
               if path not in WRITTEN_BY_TOOLS and not (ROOT / path).is_file()]
    assert not missing, "\n".join(missing)


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        inside = False
        for number, line in enumerate(page.read_text().splitlines(), 1):
            inside ^= bool(FENCE.match(line))
            broken += [f"{relative(page)}:{number}: link to {target}: no such file"
                       for target in ([] if inside else LINK.findall(line))
                       if not re.match(r"[a-z]+:|#", target)
                       and not (page.parent / target.partition("#")[0]).exists()]
    assert not broken, "\n".join(broken)


def test_the_lookup_error_in_plugins_md_is_the_real_one():
    page = (ROOT / "docs" / "plugins.md").read_text()
    section = page.split("## Where the lookups fail", 1)[1]
    shown = section.split("```\n", 2)[1].strip()
    with pytest.raises(KeyError) as raised:
        OBJECTIVES.get("TripletLos")
    real = f"{type(raised.value).__module__}.{type(raised.value).__name__}: {raised.value}"
    assert shown == real, "docs/plugins.md 'Where the lookups fail' shows another message"


def flag_table() -> list[tuple[str, str]]:
    """``(mmgoal command, what it sets)`` of getting_started.md's open_clip_train table."""
    text = (ROOT / "docs" / "getting_started.md").read_text()
    section = text.split("### open_clip_train flag -> mmgoal", 1)[1].split("\n#", 1)[0]
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in section.splitlines() if line.startswith("| `")]
    return [(row[1].strip("`"), row[2]) for row in rows]


def test_every_open_clip_train_flag_row_sets_its_key(tmp_path, monkeypatch, capsys):
    from mmgoal.cli.train import main

    rows = flag_table()
    assert len(rows) >= 15
    monkeypatch.chdir(tmp_path)  # a folder of make-synthetic's shard names
    (tmp_path / "data" / "synthetic").mkdir(parents=True)
    for split in ("train", "val", "test"):
        (tmp_path / "data" / "synthetic" / f"{split}-000000.tar").touch()
    for command, sets in rows:
        assert main(shlex.split(command)[2:] + ["--print-config"]) == 0, command
        printed = yaml.safe_load(capsys.readouterr().out)
        for key, value in (pair.split("=", 1) for pair in re.findall(r"`([\w.]+=[^`]+)`", sets)):
            got = printed
            for part in key.split("."):
                got = got[part]
            assert got == yaml.safe_load(value), (command, key)
