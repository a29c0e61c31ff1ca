"""Check an installed mmgoal as a user has it: the ``mmgoal`` command from an empty folder.

    make check-install                      # a wheel of the clone, in a fresh venv
    python tools/check_install.py           # the environment at hand, from a temporary folder

In a temporary empty folder it runs, as a user would after ``pip install``:
``mmgoal --help``, ``python -m mmgoal --help``, ``mmgoal configs``, ``mmgoal train
quickstart --print-config``, then ``mmgoal make-synthetic`` (tiny), ``mmgoal train
quickstart`` (shrunk by ``--cfg-options`` to seconds), ``mmgoal eval`` of the run
(its test metrics must equal the run's report), ``mmgoal export`` to safetensors and
``mmgoal search`` one query; then ``GoalLoss`` in a plain PyTorch loop; then lists
the optional extras and, for each one that is missing, checks that what needs it
says which extra installs it.

``--clone DIR`` (``make check-install`` passes the repository): every command runs
with an audit hook that refuses to open, list or import anything under DIR, so
the installed package must stand alone (its configs, its code), and ``mmgoal`` must
be imported from outside DIR.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import yaml

import mmgoal
from mmgoal.extras import EXTRAS, pyplot
from mmgoal.registry import LOGGERS, STRATEGIES

# configs/quickstart.yaml shrunk to seconds on the tiny benchmark make-synthetic writes below
TINY = ["model.embed_dim=16", "model.image_encoder.model_kwargs.widths=[8,16]",
        "model.text_encoder.word_dim=8", "model.text_encoder.hidden_size=16",
        "data.image_size=32", "data.num_workers=0", "data.train.batch_size=16",
        "train.epochs=1", "train.progress=false", "train.device=cpu"]  # the shards it finds

# Installed by sitecustomize in every command's interpreter when --clone is given.
GUARD = '''
import os, sys
CLONE = os.path.realpath(os.environ["MMGOAL_CHECK_CLONE"])
EVENTS = {"open", "os.listdir", "os.scandir", "os.chdir"}


def guard(event, args):
    if event in EVENTS and args and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.fsdecode(args[0])
        real = os.path.realpath(path)
        if real == CLONE or real.startswith(CLONE + os.sep):
            raise PermissionError(f"check-install: the installed mmgoal reached into the "
                                  f"clone: {event} {path}")


sys.addaudithook(guard)
'''

# GoalLoss in a loop of one's own: two linear towers over paired random features
PLAIN_LOOP = '''
import torch, torch.nn.functional as F
from mmgoal import GoalLoss
torch.manual_seed(0)
images, texts = torch.randn(64, 24), torch.randn(64, 20)
towers = torch.nn.ModuleList([torch.nn.Linear(24, 16), torch.nn.Linear(20, 16)])
optimizer = torch.optim.AdamW(towers.parameters(), lr=0.05)
goal = GoalLoss(triplet="cir", pair={"type": "sig_ms", "lam": "auto"})
def recall_at_1():
    with torch.no_grad():
        scores = F.normalize(towers[0](images), dim=-1) @ F.normalize(towers[1](texts), dim=-1).T
    return (scores.argmax(1) == torch.arange(64)).float().mean().item()
before = recall_at_1()
for step in range(30):
    loss = goal(F.normalize(towers[0](images), dim=-1), F.normalize(towers[1](texts), dim=-1))
    optimizer.zero_grad(); loss.backward(); optimizer.step()
print(f"{before} {recall_at_1()} {goal.last_stats['lam']}")
'''


def command(args: list[str], cwd: Path, env: dict, what: str) -> str:
    """Run ``args`` in ``cwd``; its stdout, or SystemExit with its output."""
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=900)
    if result.returncode != 0:
        raise SystemExit(f"error: {what}: `{' '.join(args)}` exited with {result.returncode}"
                         f"\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result.stdout


def check(condition: bool, message: str) -> None:
    if not condition:
        raise SystemExit(f"error: {message}")


def check_the_command(folder: Path, env: dict) -> None:
    """The ``mmgoal`` command from ``folder``, as a user runs it."""
    mmgoal_command = str(Path(sys.executable).with_name("mmgoal"))
    run = [mmgoal_command]
    listed = command([*run, "--help"], folder, env, "mmgoal --help")
    check(all(f"  {name} " in listed for name in ("train", "eval", "export", "search",
                                                   "configs")),
          f"mmgoal --help does not list its commands:\n{listed}")
    command([sys.executable, "-m", "mmgoal", "--help"], folder, env, "python -m mmgoal --help")
    configs = command([*run, "configs"], folder, env, "mmgoal configs")
    check("quickstart " in configs, "mmgoal configs does not list quickstart")
    printed = yaml.safe_load(command([*run, "train", "quickstart", "--print-config"], folder,
                                     env, "mmgoal train quickstart --print-config"))
    check(printed["model"]["type"] == "DualEncoder", "the printed quickstart is not its config")
    print("  mmgoal --help, python -m mmgoal --help, mmgoal configs, --print-config: ok")

    start = time.perf_counter()
    command([*run, "make-synthetic", "--out", "data/synthetic", "--train", "64", "--val", "32",
             "--test", "32", "--image-size", "32", "--shard-size", "32"], folder, env,
            "mmgoal make-synthetic")
    command([*run, "train", "quickstart", "--work-dir", "work_dirs/quickstart",
             "--cfg-options", *TINY], folder, env, "mmgoal train quickstart")
    report = json.loads((folder / "work_dirs" / "quickstart" / "report.json").read_text())
    print(f"  mmgoal train quickstart (tiny, 1 epoch, {time.perf_counter() - start:.0f}s): "
          f"test rsum {report['test']['rsum']:.1f}")
    command([*run, "eval", "work_dirs/quickstart", "--device", "cpu", "--out", "eval.json"],
            folder, env, "mmgoal eval")
    evaluated = json.loads((folder / "eval.json").read_text())["metrics"]
    check(all(abs(evaluated[k] - report["test"][k]) < 1e-6 for k in ("i2t_r1", "t2i_r1", "rsum")),
          f"mmgoal eval of the run gives {evaluated}, its report {report['test']}")
    command([*run, "export", "work_dirs/quickstart", "--best", "--out", "quickstart.safetensors"],
            folder, env, "mmgoal export")
    hits = command([*run, "search", "quickstart.safetensors", "--images",
                    "data/synthetic/test-000000.tar", "--query", "a large red circle",
                    "--top-k", "3", "--device", "cpu"], folder, env, "mmgoal search")
    rows = [line.split() for line in hits.splitlines() if line.strip()[:1].isdigit()]
    scores = [float(row[1]) for row in rows]
    check(len(rows) == 3 and scores == sorted(scores, reverse=True),
          f"mmgoal search did not print 3 hits by score:\n{hits}")
    print(f"  mmgoal eval (equal to the report), export, search (top score {scores[0]:.3f}): ok")

    before, after, lam = map(float, command([sys.executable, "-c", PLAIN_LOOP], folder, env,
                                            "GoalLoss in a plain loop").split())
    check(after > max(2 * before, 0.25), f"GoalLoss did not train two towers: recall@1 "
                                         f"{before} -> {after} (chance: 1/64)")
    print(f"  GoalLoss in a plain loop, 30 steps: recall@1 {before:.2f} -> {after:.2f}, "
          f"lam: auto at {lam:.3f}")


def missing_extra_messages() -> list[str]:
    """For each optional package that is not installed, the error of what needs it."""
    needs = {"deepspeed": lambda: STRATEGIES.build({"type": "deepspeed"}),
             "accelerate": lambda: STRATEGIES.build({"type": "accelerate"}),
             "matplotlib": lambda: pyplot("mmgoal plot-weights"),
             "tensorboard": lambda: LOGGERS.build({"type": "TensorBoardLogger"}),
             "wandb": lambda: LOGGERS.build({"type": "WandbLogger"})}
    failures = []
    for module, extra in EXTRAS.items():
        if importlib.util.find_spec(module) is not None:
            print(f"  {module:<12} installed")
            continue
        print(f"  {module:<12} not installed (extra {extra!r})")
        if module not in needs:
            continue
        try:
            needs[module]()
        except ImportError as error:
            if f"pip install 'mmgoal[{extra}]'" not in str(error):
                failures.append(f"{module}: the error does not name the extra: {error}")
        else:
            failures.append(f"{module} is not installed, yet what needs it did not fail")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clone", type=Path,
                        help="the repository: mmgoal must not be imported from it, and no "
                             "command may read a file of it")
    args = parser.parse_args(argv)
    package = Path(mmgoal.__file__).resolve().parent
    print(f"mmgoal {mmgoal.__version__} from {package}")
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        if args.clone:
            clone = args.clone.resolve()
            if package.is_relative_to(clone):
                print(f"error: mmgoal was imported from the clone {clone}, not from the "
                      f"installed package", file=sys.stderr)
                return 1
            guard = Path(tmp, "guard")
            guard.mkdir()
            (guard / "sitecustomize.py").write_text(textwrap.dedent(GUARD))
            env.update(PYTHONPATH=str(guard), MMGOAL_CHECK_CLONE=str(clone))
        folder = Path(tmp, "empty")
        folder.mkdir()
        check_the_command(folder, env)
    print("optional extras:")
    failures = missing_extra_messages()
    for failure in failures:
        print(f"error: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
