"""Export a run's weights as one plain file that a single process loads.

    python tools/export.py work_dirs/run1 --out run1.pt            # latest checkpoint
    python tools/export.py work_dirs/run1 --best --out run1_best.pt
    python tools/export.py work_dirs/run1 --best --out run1.safetensors
    python tools/evaluate.py run1.pt           # the config travels inside the file

and from Python ``mmgoal.load("run1.safetensors")``.

Whatever strategy wrote the run (one process, ``torchrun``, DeepSpeed ZeRO 0-3,
bf16), the file holds the float32 model weights, the tokenizer and the config:
``{"model", "tokenizer", "config"}`` in the mmgoal checkpoint format, loadable
with ``torch.load(..., weights_only=True)``. No optimizer state, no DeepSpeed.
An ``--out`` ending in ``.safetensors`` writes the weights as safetensors with
the config, tokenizer, source and format version (``mmgoal-safetensors/1``) as
JSON in the file's metadata.

``--out`` is a new file or an earlier export: a run's own checkpoints (best.pt,
last.pt) and other files are never overwritten, and weights holding NaN/inf
(written by an older mmgoal as its run diverged) are refused.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mmgoal.runs.checkpoint import (
    CheckpointWriteError,
    check_finite_weights,
    load_checkpoint,
    save_checkpoint,
    save_safetensors,
)
from mmgoal.runs.run_dir import weights_file


def check_out(out: Path) -> None:
    """Refuse an ``--out`` that is a folder, or a file other than an earlier export.

    Raises:
        ValueError: saying what ``out`` is and what to give instead.
    """
    if out.is_dir():
        raise ValueError(f"--out {out} is a folder; give a file name, e.g. {out / 'model.pt'}")
    if not out.exists():
        return
    try:
        exported = "exported_from" in load_checkpoint(out)
    except ValueError:  # not an mmgoal checkpoint at all
        exported = False
    if not exported:
        raise ValueError(f"--out {out} exists and is not an earlier export (a run's own "
                         f"checkpoint or another file), so it is not overwritten; give a new "
                         f"file name")


def export(source: Path, out: Path, best: bool = False) -> dict:
    """Write the weights of ``source`` (a run folder or a checkpoint file) to ``out``
    (safetensors when its name ends in ``.safetensors``).

    Raises:
        FileNotFoundError: no checkpoint at ``source``.
        ValueError: a bad ``out`` (:func:`check_out`), or weights holding NaN/inf.
    """
    check_out(out)
    path = weights_file(source, "best" if best else "latest")
    state = load_checkpoint(path)
    check_finite_weights(state["model"], f"checkpoint {path}")
    weights = {k: v.float() if v.is_floating_point() else v for k, v in state["model"].items()}
    exported = {"model": weights, "tokenizer": state["tokenizer"], "config": state["config"],
                "epoch": state.get("epoch"), "exported_from": str(path)}
    (save_safetensors if out.suffix == ".safetensors" else save_checkpoint)(exported, out)
    return {"source": str(path), "tensors": len(weights),
            "parameters": sum(v.numel() for v in weights.values())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("source", type=Path, help="run directory or checkpoint file")
    parser.add_argument("--out", type=Path, required=True,
                        help="file to write (new, or an earlier export)")
    parser.add_argument("--best", action="store_true", help="the best epoch, not the latest")
    args = parser.parse_args(argv)
    try:
        summary = export(args.source, args.out, args.best)
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except CheckpointWriteError as error:  # a full disk: --out is untouched
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"{args.out}: {summary['parameters']} values in {summary['tensors']} tensors "
          f"from {summary['source']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
