"""Export a run's weights: one plain file, the folder open_clip or transformers loads, or a
LoRA run's adapters as peft's adapter folder.

    mmgoal export work_dirs/run1 --out run1.pt      # best.pt, else the latest (as mmgoal eval)
    mmgoal export work_dirs/run1 --latest --out run1.safetensors
    mmgoal export work_dirs/clip --format open_clip --out clip_goal/ [--push-to-hub you/clip-goal]
    mmgoal export work_dirs/hfclip --format hf --out hfclip_goal/
    mmgoal export work_dirs/clip_lora --format peft --out clip_lora_adapters/

The file holds the float32 weights, tokenizer and config whatever strategy wrote the run
(docs/distributed.md, "Checkpoints, resume, export"); a LoRA run is exported merged in
every format but ``peft``. The folder formats, what loads them and ``--push-to-hub``:
docs/models.md, "Take a fine-tuned model elsewhere"; what ``--out`` may be and never
overwrites: docs/received_files.md.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from mmgoal import strict_json
from mmgoal.cli.arguments import (
    INPUT_ERRORS,
    add_offline_option,
    apply_loading_options,
    check_out_file,
    print_error,
    tool_parser,
)
from mmgoal.config import first_line
from mmgoal.files import LinkedPathError, staged_folder, write_text
from mmgoal.runs.run_dir import EXPORT_FOLDERS, EXPORT_MANIFEST, weights_file

if TYPE_CHECKING:  # torch: imported past --help
    from mmgoal.runs.loading import LoadedModel

# A LoRA run's adapters alone, as peft's save_pretrained writes them (any family with
# model.peft); the other folder formats are a family's whole model (EXPORT_FOLDERS)
PEFT_FORMAT = "peft"
FOLDER_FORMATS = (*EXPORT_FOLDERS, PEFT_FORMAT)


def is_export(out: Path) -> bool:
    from mmgoal.runs.checkpoint import load_checkpoint

    try:
        return "exported_from" in load_checkpoint(out)
    except ValueError:  # not an mmgoal checkpoint at all
        return False


def check_out(out: Path) -> None:
    """Refuse an ``--out`` that is a folder, or a file other than an earlier export."""
    check_out_file(out, is_export, "an earlier export", "model.pt")


def export(source: Path, out: Path, which: str = "best_or_latest",
           trust_custom_imports: bool = False, wise_ft: float | None = None) -> dict:
    """Write the weights of ``source`` (a run folder or a checkpoint file) to ``out``
    (safetensors when its name ends in ``.safetensors``); a LoRA run's merged, with
    ``model.peft: null`` in the config written; with ``wise_ft``, the weights mixed with
    the pretrained start at that alpha (mmgoal/evaluation/wise_ft.py).

    Raises:
        FileNotFoundError: no checkpoint at ``source``.
        ValueError: a bad ``out`` (:func:`check_out`), or weights holding NaN/inf.
    """
    from mmgoal.models.lora import AdapterCount, has_adapters, merge_adapters
    from mmgoal.runs.checkpoint import (
        check_finite_weights,
        load_checkpoint,
        save_checkpoint,
        save_safetensors,
    )
    from mmgoal.runs.loading import load_for_evaluation
    from mmgoal.runs.schema import warn_not_imported

    check_out(out)
    path = weights_file(source, which)
    state = load_checkpoint(path)
    check_finite_weights(state["model"], f"checkpoint {path}")
    weights, config, merged = state["model"], state["config"], AdapterCount()
    builds = has_adapters(config) or wise_ft is not None  # the model is built (its weights)
    if not builds and (config or {}).get("custom_imports") and not trust_custom_imports:
        warn_not_imported(list(config["custom_imports"]), str(path))  # as eval says it
    if builds:
        loaded = load_for_evaluation(path, device="cpu",
                                     trust_custom_imports=trust_custom_imports)
        if wise_ft is not None:
            from mmgoal.evaluation.wise_ft import WiseFT

            mix = WiseFT(loaded)  # merges the adapters of the start and the fine-tune
            merged, weights = mix.merged, mix.weights(wise_ft)
        else:
            merged = merge_adapters(loaded.model)
            weights = loaded.model.state_dict()
        if has_adapters(config):
            config = {**config, "model": {**config["model"], "peft": None}}
    weights = {k: v.float() if v.is_floating_point() else v for k, v in weights.items()}
    exported = {"model": weights, "tokenizer": state["tokenizer"], "config": config,
                "epoch": state.get("epoch"), "exported_from": str(path)}
    if wise_ft is not None:
        exported["wise_ft_alpha"] = wise_ft
    (save_safetensors if out.suffix == ".safetensors" else save_checkpoint)(exported, out,
                                                                          AGAIN)
    return {"source": str(path), "tensors": len(weights),
            "parameters": sum(v.numel() for v in weights.values()), "merged": merged}


# What a failed export tells the user to do once the disk has room
AGAIN = "run the export again"


def check_out_folder(out: Path, fmt: str) -> set[str]:
    """Refuse an ``--out`` for a folder format that is a file, or a folder holding anything
    but an earlier export of that format by mmgoal (its :data:`EXPORT_MANIFEST` says so).

    Returns:
        The files the earlier export wrote there (which the new one may replace).
    """
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; --format {fmt} writes a folder: give a new "
                         f"folder name")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not held:
        return set()
    manifest = earlier_export(out)
    if manifest is None or manifest["format"] != fmt:
        what = (f"an earlier --format {manifest['format']} export" if manifest else
                f"files mmgoal did not write ({', '.join(held[:3])}"
                f"{', ...' if len(held) > 3 else ''}), no earlier export of mmgoal's (it "
                f"would hold {EXPORT_MANIFEST})")
        raise ValueError(f"--out {out} is a folder holding {what}, so nothing is written into "
                         f"it; give a new or empty folder")
    return set(manifest["files"])


def earlier_export(out: Path) -> dict | None:
    """The manifest of the folder export mmgoal wrote at ``out``, or None: none, or one that
    is not what mmgoal writes."""
    from mmgoal.files import MAX_LIST_BYTES, read_text

    try:
        manifest = json.loads(read_text(out / EXPORT_MANIFEST, "export manifest",
                                        MAX_LIST_BYTES))
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") not in FOLDER_FORMATS or \
            not isinstance(manifest.get("files"), list):
        return None
    return manifest


def export_folder(source: Path, out: Path, fmt: str, which: str = "best_or_latest",
                  trust_custom_imports: bool = False, wise_ft: float | None = None) -> dict:
    """Write the model of ``source`` in ``fmt``'s folder layout (the family's ``export_to``),
    or its LoRA adapters as peft's folder (``fmt`` ``peft``); with ``wise_ft``, its weights
    mixed with the pretrained start at that alpha.

    Raises:
        FileNotFoundError: no checkpoint at ``source``.
        ValueError: a bad ``out``, a model family without that format, or ``peft`` of a run
            without adapters or with ``wise_ft``.
    """
    from mmgoal.runs.checkpoint import CheckpointWriteError
    from mmgoal.runs.loading import load_for_evaluation

    ours = check_out_folder(out, fmt)
    if fmt == PEFT_FORMAT and wise_ft is not None:
        raise ValueError("--wise-ft mixes the whole weights, and --format peft writes adapters "
                         "alone, which cannot hold the mix: export it with --format mmgoal, or "
                         "the family's open_clip or hf")
    path = weights_file(source, which)
    loaded = load_for_evaluation(path, device="cpu", trust_custom_imports=trust_custom_imports)
    summary, write = (peft_writer(loaded, path) if fmt == PEFT_FORMAT else
                      model_writer(loaded, fmt, wise_ft))
    # the family's writer (a library's save_pretrained among them) writes into a new folder;
    # its files then move into --out, never through a link there nor over a file mmgoal did
    # not write
    try:
        with staged_folder(out) as staging:
            written = write(staging)
            foreign = sorted(name for name in written if name not in ours and
                             os.path.lexists(out / name))
            if foreign:
                raise ValueError(f"--out {out} holds {', '.join(foreign)}, which the earlier "
                                 f"export did not write and this one would replace; nothing "
                                 f"was written: move them away, or give a new folder")
            manifest = {"format": fmt, "files": written, "source": str(path)}
            if fmt == PEFT_FORMAT:  # what to load the adapters onto, as the run built it
                manifest["base_model"] = {key: value for key, value in
                                          loaded.config["model"].items() if key != "peft"}
            write_text(staging / EXPORT_MANIFEST, strict_json.dumps(manifest, indent=2))
    except (ValueError, LinkedPathError):
        raise
    except Exception as error:  # a full disk: the library's own error (SafetensorError...)
        reason = getattr(error, "strerror", None) or first_line(error)
        kept = "the earlier export there is intact" if ours else "nothing was written there"
        raise CheckpointWriteError(f"could not write the {fmt} export into {out} ({reason}); "
                                   f"{kept}: an export is written beside it and moved in only "
                                   f"once complete. Free space (or fix the folder), then "
                                   f"{AGAIN}") from error
    return {"source": str(path), "files": written, **summary}


def model_writer(loaded: LoadedModel, fmt: str, wise_ft: float | None) -> tuple[dict, Callable]:
    """What :func:`export_folder` says of a whole-model format (``merged``: the adapters
    folded into the weights) and the writer of ``loaded`` into a folder."""
    from mmgoal.models.lora import AdapterCount, has_adapters, merge_adapters

    merged = merge_adapters(loaded.model) if has_adapters(loaded.config) else AdapterCount()
    formats = getattr(type(loaded.model), "EXPORT_FORMATS", ())
    if fmt not in formats:
        others = ", ".join(["mmgoal", *formats])
        raise ValueError(f"a {type(loaded.model).__name__} model has no {fmt} format: it is "
                         f"exported as {others} (--format); open_clip's layout is for "
                         f"OpenCLIP runs, Hugging Face's for HFCLIP runs")
    if wise_ft is not None:
        from mmgoal.evaluation.wise_ft import WiseFT

        loaded.model.load_state_dict(WiseFT(loaded).weights(wise_ft))
    return {"merged": merged}, partial(loaded.model.export_to, fmt, tokenizer=loaded.tokenizer,
                                       transform=loaded.transform)


def peft_writer(loaded: LoadedModel, path: Path) -> tuple[dict, Callable]:
    """What :func:`export_folder` says of ``--format peft`` (``adapters``: how many; ``left
    out``: what the run trained beside them) and the writer of the adapters of ``loaded``
    (the model of the checkpoint ``path``) into a folder."""
    from mmgoal.models.lora import adapted_model, adapter_count, has_adapters, save_adapters
    from mmgoal.runs.loading import pretrained_weights

    if not has_adapters(loaded.config):
        raise ValueError(f"--format peft writes a LoRA run's adapters, and {path} holds a "
                         f"model without (its config has no model.peft): export the whole "
                         f"model with --format mmgoal, or the family's open_clip or hf")
    library_model = adapted_model(loaded.model)
    left_out = [name for name, value in library_model.named_parameters()
                if value.requires_grad and ".lora_" not in name]
    return ({"adapters": adapter_count(library_model), "left_out": left_out},
            partial(save_adapters, library_model, base_model=pretrained_weights(loaded.config)))


def adapters_note(summary: dict) -> str:
    """What the export did with LoRA adapters: `` (LoRA adapters on 0 layer(s) and 8
    weight(s) merged)`` (counted as the run's log counts them), where to load a peft
    folder's; ``""`` for a model without adapters."""
    adapters = summary.get("adapters")
    if adapters:
        names = summary["left_out"]
        left_out = (f"; {', '.join(names)}, trained beside them, {'are' if names[1:] else 'is'} "
                    f"not in it (peft's folder holds adapters alone)" if names else "")
        return (f" (LoRA adapters on {adapters}, for peft.PeftModel.from_pretrained on the "
                f"base model{left_out})")
    merged = summary["merged"]
    return f" (LoRA adapters on {merged} merged)" if merged else ""


def check_hub_repository(repo_id: str) -> None:
    """Refuse a push before anything is exported: an ill-formed repository name, or offline.

    Raises:
        ValueError: saying which, and what to do.
    """
    from huggingface_hub.utils import validate_repo_id

    from mmgoal.paths import OFFLINE_ENV, offline

    try:
        validate_repo_id(repo_id)
    except ValueError as error:  # huggingface_hub's HFValidationError
        raise ValueError(f"--push-to-hub {repo_id!r} is not a hub repository name "
                         f"({first_line(error)}); give NAMESPACE/NAME, such as "
                         f"your-name/clip-goal") from None
    if offline():
        raise ValueError(f"--push-to-hub uploads to the Hugging Face hub, and {OFFLINE_ENV} is "
                         f"set, so nothing was exported: run it with {OFFLINE_ENV} unset "
                         f"(env -u {OFFLINE_ENV} mmgoal export ...), or export without "
                         f"--push-to-hub")


def push_to_hub(out: Path, files: list[str], repo_id: str, private: bool,
                commit_message: str) -> str:
    """Upload the export at ``out`` (a file, or the ``files`` of a folder) to the root of the
    hub model repository ``repo_id``, created if missing (private with ``private``), in a
    commit: huggingface_hub's endpoint and token, as it finds them.

    Returns:
        The commit's URL.
    """
    from huggingface_hub import HfApi

    api = HfApi()
    repo = api.create_repo(repo_id, private=True if private else None, exist_ok=True)
    if out.is_dir():
        commit = api.upload_folder(repo_id=repo.repo_id, folder_path=out, allow_patterns=files,
                                   commit_message=commit_message)
    else:
        commit = api.upload_file(path_or_fileobj=out, path_in_repo=out.name,
                                 repo_id=repo.repo_id, commit_message=commit_message)
    return commit.commit_url


def push_failure(error: Exception, out: Path, repo_id: str) -> str:
    """What a failed push says: what stays, what went wrong, what to do."""
    from huggingface_hub import constants, get_token

    status = getattr(getattr(error, "response", None), "status_code", None)
    if status in (401, 403):
        advice = ("no token was found: set HF_TOKEN or log in with `hf auth login`"
                  if get_token() is None else
                  f"the token (HF_TOKEN's, or the one `hf auth login` saved) may lack write "
                  f"access to {repo_id}: give one that has it")
    else:
        advice = "check the repository name, the network and HF_ENDPOINT"
    return (f"{out} is exported, but pushing it to {repo_id} on {constants.ENDPOINT} failed "
            f"({first_line(error)}); {advice}, then run the command again (it exports over "
            f"its own earlier export and pushes again)")


def main(argv: list[str] | None = None) -> int:
    parser = tool_parser(__doc__)
    parser.add_argument("source", type=Path, help="run directory or checkpoint file")
    parser.add_argument("--out", type=Path, required=True,
                        help="file to write (new, or an earlier export); a folder for "
                             "--format open_clip, hf and peft")
    chosen = parser.add_mutually_exclusive_group()
    chosen.add_argument("--best", dest="which", action="store_const", const="best",
                        default="best_or_latest",
                        help="the best epoch's best.pt only (an error where the run has none); "
                             "by default best.pt where the run validated, else its latest "
                             "checkpoint, as mmgoal eval picks")
    chosen.add_argument("--latest", dest="which", action="store_const", const="latest",
                        help="the latest checkpoint (last.pt, or DeepSpeed's newest tag)")
    parser.add_argument("--format", default="mmgoal", choices=["mmgoal", *FOLDER_FORMATS],
                        help="mmgoal's own file (default), open_clip's folder (OpenCLIP "
                             "runs), a Hugging Face save_pretrained folder (HFCLIP runs), or "
                             "a LoRA run's adapters as peft's save_pretrained folder")
    parser.add_argument("--wise-ft", type=float, metavar="ALPHA",
                        help="WiSE-FT: export (1 - ALPHA) x the pretrained weights the run "
                             "started from + ALPHA x its fine-tuned ones (0 <= ALPHA <= 1; "
                             "docs/models.md, 'Fine-tune without forgetting')")
    parser.add_argument("--trust-custom-imports", action="store_true",
                        help="with --format open_clip/hf/peft, a LoRA run (model.peft) or "
                             "--wise-ft: import the custom_imports the run's config names (the "
                             "model is built)")
    parser.add_argument("--push-to-hub", metavar="REPO_ID",
                        help="then upload the export to this Hugging Face hub model repository "
                             "(NAMESPACE/NAME, created if missing), through huggingface_hub: "
                             "HF_ENDPOINT, HF_TOKEN or `hf auth login`")
    parser.add_argument("--private", action="store_true",
                        help="with --push-to-hub: a repository it creates is private")
    parser.add_argument("--commit-message",
                        help="with --push-to-hub: the commit's message (default: Upload mmgoal "
                             "export, FORMAT format)")
    add_offline_option(parser)
    args = parser.parse_args(argv)
    if args.push_to_hub is None and (args.private or args.commit_message is not None):
        parser.error("--private and --commit-message go with --push-to-hub")
    if args.wise_ft is not None and not 0 <= args.wise_ft <= 1:
        parser.error(f"--wise-ft ALPHA lies in [0, 1] (0: the pretrained start, 1: the "
                     f"fine-tune), got {args.wise_ft}")
    if args.offline and args.push_to_hub is not None:
        parser.error("--offline downloads nothing and --push-to-hub uploads: give one of them")
    apply_loading_options(args)  # --offline: a --wise-ft start named on the hub is not fetched
    from mmgoal.runs.checkpoint import CheckpointWriteError  # torch: past --help

    try:
        if args.push_to_hub is not None:
            check_hub_repository(args.push_to_hub)
        if args.format != "mmgoal":
            summary = export_folder(args.source, args.out, args.format, args.which,
                                    args.trust_custom_imports, args.wise_ft)
            files = summary["files"]
            print(f"{args.out}: {', '.join(files)} ({args.format}) from {summary['source']}"
                  f"{adapters_note(summary)}")
        else:
            summary = export(args.source, args.out, args.which, args.trust_custom_imports,
                             args.wise_ft)
            files = [args.out.name]
            print(f"{args.out}: {summary['parameters']} values in {summary['tensors']} tensors "
                  f"from {summary['source']}{adapters_note(summary)}")
    except INPUT_ERRORS as error:  # ImportError: a plug-in
        return print_error(error)
    except (CheckpointWriteError, OSError) as error:  # a full disk: --out is untouched
        return print_error(error, status=1)
    if args.push_to_hub is None:
        return 0
    message = args.commit_message or f"Upload mmgoal export, {args.format} format"
    try:
        url = push_to_hub(args.out, files, args.push_to_hub, args.private, message)
    except Exception as error:  # huggingface_hub's HTTP errors, the network's, a bad token
        return print_error(push_failure(error, args.out, args.push_to_hub), status=1)
    print(f"pushed {', '.join(files)} to {args.push_to_hub}: {url}")
    return 0



if __name__ == "__main__":
    sys.exit(main())
