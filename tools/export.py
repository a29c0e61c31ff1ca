"""Export a run's weights as one plain file that a single process loads.

    python tools/export.py work_dirs/run1 --out run1.pt            # latest checkpoint
    python tools/export.py work_dirs/run1 --best --out run1_best.pt
    python tools/evaluate.py configs/quickstart.yaml run1.pt

Whatever strategy wrote the run (one process, ``torchrun``, DeepSpeed ZeRO 0-3,
bf16), the file holds the float32 model weights, the tokenizer and the config:
``{"model", "tokenizer", "config"}`` in the mmgoal checkpoint format, loadable
with ``torch.load(..., weights_only=True)``. No optimizer state, no DeepSpeed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mmgoal.engine.checkpoint import load_checkpoint, save_checkpoint
from mmgoal.engine.strategies.base import LATEST, read_pointer


def run_weights(run: Path, best: bool = False) -> Path:
    """The file with a run's float32 weights: best.pt, a DeepSpeed tag's weights.pt or last.pt.

    Raises:
        FileNotFoundError: the folder holds no complete checkpoint.
    """
    checkpoints = run / "checkpoints" if (run / "checkpoints").is_dir() else run
    if best:
        path = checkpoints / "best.pt"
    elif (tag := read_pointer(checkpoints / "deepspeed" / LATEST)) is not None:
        path = checkpoints / "deepspeed" / tag / "weights.pt"
    else:
        path = checkpoints / "last.pt"
    if not path.is_file():
        raise FileNotFoundError(f"{run} holds no {'best' if best else 'complete'} checkpoint "
                                f"(looked for {path})")
    return path


def export(source: Path, out: Path, best: bool = False) -> dict:
    """Write the weights of ``source`` (a run folder or a checkpoint file) to ``out``."""
    path = source if source.is_file() else run_weights(source, best)
    state = load_checkpoint(path)
    weights = {k: v.float() if v.is_floating_point() else v for k, v in state["model"].items()}
    save_checkpoint({"model": weights, "tokenizer": state["tokenizer"], "config": state["config"],
                     "exported_from": str(path)}, out)
    return {"source": str(path), "tensors": len(weights),
            "parameters": sum(v.numel() for v in weights.values())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("source", type=Path, help="run directory or checkpoint file")
    parser.add_argument("--out", type=Path, required=True, help="file to write")
    parser.add_argument("--best", action="store_true", help="the best epoch, not the latest")
    args = parser.parse_args(argv)
    try:
        summary = export(args.source, args.out, args.best)
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"{args.out}: {summary['parameters']} values in {summary['tensors']} tensors "
          f"from {summary['source']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
