"""The front door's cost: each command that should answer at once, against ``import torch``.

    python bench/startup.py              # 5 runs each, the median
    python bench/startup.py --runs 9

Each line is a fresh interpreter (``python -c ...``), so what is timed is what a user
waits for: interpreter start, imports, the answer. The baseline, ``python -c "import
torch"``, is timed in the same run, and each ratio is the median against its median.
docs/architecture.md ("What is loaded when") says why these import no torch; the goal
of issue 40 is ``mmgoal --help`` at most 0.3x the baseline.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

BASELINE = ("import torch", "import torch")
CASES = (
    ("mmgoal --help", "from mmgoal.cli.main import main; main(['--help'])"),
    ("mmgoal --version", "from mmgoal.cli.main import main; main(['--version'])"),
    ("mmgoal train --help", "from mmgoal.cli.main import main; main(['train', '--help'])"),
    ("mmgoal eval --help", "from mmgoal.cli.main import main; main(['eval', '--help'])"),
    ("mmgoal configs", "from mmgoal.cli.main import main; main(['configs'])"),
    ("import mmgoal", "import mmgoal"),
    ("import mmgoal; mmgoal.GoalLoss", "import mmgoal; mmgoal.GoalLoss"),
)


def seconds(code: str, runs: int) -> float:
    """The median wall time of ``python -c code`` over ``runs`` fresh interpreters."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=False)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="interpreters per case (median)")
    args = parser.parse_args(argv)
    baseline = seconds(BASELINE[1], args.runs)
    print(f"{BASELINE[0]:<32} {baseline:6.3f} s (the baseline)")
    for name, code in CASES:
        took = seconds(code, args.runs)
        print(f"{name:<32} {took:6.3f} s, ratio to import torch {took / baseline:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
