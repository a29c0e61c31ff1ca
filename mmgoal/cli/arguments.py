"""Options and checks that several tools take alike, so each reads and behaves the same."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mmgoal.config import SHIPPED_CONFIGS, find_config
from mmgoal.files import refuse_link
from mmgoal.paths import go_offline

# What a tool reports in one line, exiting with status 2, rather than with a traceback: a
# file that is not there, a value that is wrong, a missing extra or plug-in.
INPUT_ERRORS = (FileNotFoundError, ValueError, ImportError)


def print_error(error: BaseException | str, status: int = 2) -> int:
    """``error: <what went wrong>`` on stderr, the way every tool ends on a mistake; returns
    ``status``, the tool's exit status (2: what it was given is wrong; 1: what it did failed)."""
    print(f"error: {error}", file=sys.stderr)
    return status


def summary(doc: str) -> str:
    """A tool's one-line description: the first paragraph of its module docstring."""
    return " ".join(doc.strip().split("\n\n", 1)[0].split())


def tool_parser(doc: str, **kwargs) -> argparse.ArgumentParser:
    """The parser of a tool whose module docstring is ``doc``. Its program name is
    ``sys.argv[0]``'s: ``mmgoal train`` under the ``mmgoal`` command (mmgoal/cli/main.py),
    ``finetune.py`` from tools/."""
    return argparse.ArgumentParser(description=summary(doc), **kwargs)


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def names_shipped_config(text: str) -> bool:
    """``text`` is no file but names a config (``quickstart``: :func:`find_config`)."""
    if Path(text).exists():
        return False
    try:
        find_config(text)
    except FileNotFoundError:
        return False
    return True


def config_argument(text: str) -> str:
    """A config the command line names: the file, or the config that name finds
    (:func:`mmgoal.config.find_config`: a clone's ``configs/NAME.yaml``, mmgoal's shipped
    one); which file, in the log (or on stderr) when it is not ``text`` itself.

    Raises:
        FileNotFoundError: none, with the closest shipped names.
    """
    path = find_config(text)
    if path != Path(text):
        where = "mmgoal's shipped " if path.is_relative_to(SHIPPED_CONFIGS) else ""
        message = f"config {text}: {where}{path}"
        if logging.getLogger().handlers:
            logging.info(message)
        else:
            print(message, file=sys.stderr)
    return str(path)


def add_device_option(parser: argparse.ArgumentParser) -> None:
    """``--device``, where a tool encodes and scores (:func:`mmgoal.devices.resolve_device`
    reads it)."""
    parser.add_argument("--device", default="auto",
                        help="auto (the GPU where there is one), cpu, cuda or cuda:N")


def add_loading_options(parser: argparse.ArgumentParser, trust_what: str = "the config or "
                        "checkpoint names") -> None:
    """``--trust-custom-imports`` and ``--offline``, for a tool that builds a model."""
    parser.add_argument("--trust-custom-imports", action="store_true",
                        help=f"import the custom_imports {trust_what} (left out otherwise: a "
                             f"file you received must not run code)")
    add_offline_option(parser)


def add_data_options(parser: argparse.ArgumentParser) -> None:
    """``--shards`` and ``--trust-data-paths``, for a tool that reads a split of the config
    (:meth:`mmgoal.runs.loading.LoadedModel.split`)."""
    parser.add_argument("--shards", nargs="+", metavar="PATTERN",
                        help="the split's shards instead of the config's: files, globs, brace "
                             "patterns, URLs or pipe: commands, read as given (they are yours)")
    parser.add_argument("--trust-data-paths", action="store_true",
                        help="read the config's or checkpoint's shards even where they run a "
                             "command (pipe:) or fetch a URL; refused otherwise, since a file "
                             "you received must not run commands or send requests")


def add_offline_option(parser: argparse.ArgumentParser) -> None:
    """``--offline``: nothing downloaded (:func:`apply_loading_options` applies it)."""
    parser.add_argument("--offline", action="store_true",
                        help="download nothing: weights, tokenizers and processors come from "
                             "local files and the caches only (as HF_HUB_OFFLINE=1)")


def apply_loading_options(args: argparse.Namespace) -> None:
    """What ``--offline`` asks, for the rest of the process."""
    if args.offline:
        go_offline()


def check_out_file(out: Path, is_earlier: Callable[[Path], bool], earlier: str,
                   example: str) -> None:
    """Refuse an ``--out`` that is a folder, or an existing file that ``is_earlier`` does not
    recognise as an earlier output of this tool (a run's own checkpoint, any other file).

    Args:
        earlier: what an earlier output is called (``an earlier export``).
        example: a file name to suggest inside a folder given by mistake.

    Raises:
        ValueError: saying what ``out`` is and what to give instead (a
            :class:`~mmgoal.files.LinkedPathError` for a symbolic link).
    """
    refuse_link(out)  # before anything reads what it points at
    if out.is_dir():
        raise ValueError(f"--out {out} is a folder; give a file name, e.g. {out / example}")
    if out.exists() and not is_earlier(out):
        raise ValueError(f"--out {out} exists and is not {earlier} (a run's own checkpoint or "
                         f"another file), so it is not overwritten; give a new file name")


# ------------------------------------------------------------ open_clip_train's flags
@dataclass(frozen=True)
class Shortcut:
    """A flag that sets one config key, as the ``--cfg-options KEY=VALUE`` it stands for.

    Attributes:
        key: the dotted key; a mapping model type -> key where it depends on the model.
        kind: the value's type (``None``: a switch that sets ``true``).
        aliases: other spellings of a value (open_clip's precision names) -> the key's.
    """

    flag: str
    key: str | dict[str, str]
    kind: type | None
    help: str
    metavar: str | None = None
    aliases: tuple[tuple[str, str], ...] = ()


MODEL_NAME_KEYS = {"OpenCLIP": "model.model_name", "HFCLIP": "model.path"}
TRAIN_SHORTCUTS = (
    Shortcut("--train-data", "data.train.shards", str, "training shards: a folder (its "
             "train-*.tar), a glob, a brace pattern (train-{000000..000099}.tar), URLs or "
             "pipe: commands", "SHARDS"),
    Shortcut("--val-data", "data.val.shards", str, "validation shards (a folder: its "
             "val-*.tar)", "SHARDS"),
    Shortcut("--test-data", "data.test.shards", str, "test shards (a folder: its test-*.tar)",
             "SHARDS"),
    Shortcut("--batch-size", "data.train.batch_size", int, "pairs per batch and process", "N"),
    Shortcut("--lr", "optimizer.lr", float, "learning rate", "LR"),
    Shortcut("--wd", "optimizer.weight_decay", float, "weight decay", "WD"),
    Shortcut("--warmup", "schedule.warmup_steps", int, "warm-up steps", "STEPS"),
    Shortcut("--epochs", "train.epochs", int, "epochs", "N"),
    Shortcut("--model", MODEL_NAME_KEYS, str, "an open_clip architecture or hub name "
             "(OpenCLIP), a Hugging Face model (HFCLIP)", "NAME"),
    Shortcut("--pretrained", "model.pretrained", str, "open_clip's pretrained tag or a "
             "weights file (OpenCLIP)", "TAG"),
    Shortcut("--precision", "train.precision", str, "fp32, bf16 or fp16 autocast; open_clip's "
             "amp and amp_bf16 too", "P",
             (("amp", "fp16"), ("amp_bf16", "bf16"), ("amp_bfloat16", "bf16"))),
    Shortcut("--workers", "data.num_workers", int, "DataLoader processes", "N"),
    Shortcut("--seed", "train.seed", int, "random seed", "N"),
    Shortcut("--lock-image", "train.lock_image", None, "freeze the image tower"),
    Shortcut("--lock-image-unlocked-groups", "train.lock_image_unlocked_groups", int,
             "with --lock-image: leave its last N layer groups trainable", "N"),
    Shortcut("--lock-text", "train.lock_text", None, "freeze the text tower"),
    Shortcut("--lock-text-unlocked-layers", "train.lock_text_unlocked_layers", int,
             "with --lock-text: leave its last N layers trainable", "N"),
)
EVAL_SHORTCUTS = (
    Shortcut("--batch-size", "data.eval_batch_size", int, "images or captions encoded at a "
             "time", "N"),
    Shortcut("--workers", "data.num_workers", int, "DataLoader processes", "N"),
)


def add_shortcuts(parser: argparse.ArgumentParser, shortcuts: tuple[Shortcut, ...],
                  recorded: bool = True) -> None:
    """The shortcut flags, in a group of ``--help`` that names the key each sets."""
    group = parser.add_argument_group(
        "open_clip_train flags", "shortcuts for config keys, applied before --cfg-options"
        + (" and recorded in the run's config like them" if recorded else ""))
    for shortcut in shortcuts:
        key = (" or ".join(f"{k} ({t})" for t, k in shortcut.key.items())
               if isinstance(shortcut.key, dict) else shortcut.key)
        options = ({"action": "store_true"} if shortcut.kind is None else
                   {"type": shortcut.kind, "metavar": shortcut.metavar})
        group.add_argument(shortcut.flag, dest=_dest(shortcut), default=None,
                           help=f"{shortcut.help}; sets {key}", **options)


def _dest(shortcut: Shortcut) -> str:
    return "shortcut_" + shortcut.flag.lstrip("-").replace("-", "_")


def shortcut_overrides(args: argparse.Namespace, shortcuts: tuple[Shortcut, ...],
                       cfg: dict) -> list[str]:
    """The ``KEY=VALUE`` overrides of the shortcut flags given (values JSON-quoted, which
    YAML reads back as given: a brace pattern stays a string)."""
    overrides = []
    for shortcut in shortcuts:
        value = getattr(args, _dest(shortcut), None)
        if value is None or value is False:
            continue
        key = shortcut.key
        if isinstance(key, dict):
            kind = (cfg.get("model") or {}).get("type")
            if kind not in key:
                raise ValueError(f"{shortcut.flag} names the model of an "
                                 f"{' or '.join(key)} config; this config's model is {kind}: "
                                 f"set its keys with --cfg-options model.KEY=VALUE")
            key = key[kind]
        value = dict(shortcut.aliases).get(value, value)
        overrides.append(f"{key}={json.dumps(value)}")
    return overrides
