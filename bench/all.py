"""Every benchmark of bench/, one after the other, then every ratio they printed.

    python bench/all.py                  # what `make bench` runs
    python bench/all.py data trainer     # some of them

Each script runs in its own process (``HF_HUB_OFFLINE=1``) with its default
arguments and its output shown as it comes; at the end, the lines that carry a
ratio (``ratio``, ``overhead``) are printed again under the script's name. The
exit status is 1 when a script failed. Measure on an idle machine: with two
cores, any other busy process slows the measured side of a ratio more than the
other. The results, with their commands and dates: docs/results/performance.md.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# the front door, data pipeline, trainer, the race against open_clip's trainer, distributed
# ITM, the feature gather, the objectives on score tiles (one process and ranks), gradient
# caching, evaluation encoding, evaluation on 2 ranks, GOAL's combinations, SCAN scoring,
# the COCO protocols
SCRIPTS = ("startup", "data", "trainer", "clip_train", "itm", "gather", "tiles",
           "grad_cache", "eval", "eval_ranks", "objectives", "scan_eval",
           "protocols")
RATIO = re.compile(r"(ratio|overhead).*\d", re.IGNORECASE)  # not a table's header


def run(name: str) -> tuple[int, list[str], float]:
    """Run bench/<name>.py, echoing its output; its return code, ratio lines and seconds."""
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, str(HERE / f"{name}.py")], cwd=HERE.parent,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "HF_HUB_OFFLINE": "1"})
    ratios = []
    for line in process.stdout:
        print(line, end="", flush=True)
        if RATIO.search(line):
            ratios.append(line.strip())
    return process.wait(), ratios, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("scripts", nargs="*", metavar="SCRIPT",
                        help=f"some of: {', '.join(SCRIPTS)} (default: all)")
    args = parser.parse_args()
    unknown = [name for name in args.scripts if name not in SCRIPTS]
    if unknown:
        parser.error(f"no benchmark {', '.join(unknown)}; there are {', '.join(SCRIPTS)}")
    args.scripts = args.scripts or list(SCRIPTS)
    summary, failed = [], []
    for name in args.scripts:
        print(f"\n===== bench/{name}.py", flush=True)
        code, ratios, seconds = run(name)
        if code:
            failed.append(name)
        summary.append((name, code, ratios, seconds))
    print("\n===== ratios")
    for name, code, ratios, seconds in summary:
        state = f"FAILED (exit {code})" if code else f"{seconds:.0f} s"
        print(f"bench/{name}.py ({state})")
        for line in ratios:
            print(f"  {line}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
