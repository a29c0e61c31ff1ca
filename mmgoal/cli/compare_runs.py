"""Compare groups of runs over seeds: test recalls (mean ± std) and paired differences.

    mmgoal compare-runs \\
        "con x con=work_dirs/fidelity/scratch/conxcon/default/seed*" \\
        "cir x sig_ms=work_dirs/fidelity/scratch_sig_ms/cirxsig_ms/lam=0.5/seed*" \\
        --out table.md

Each argument is ``LABEL=GLOB`` (or a glob alone, labelled by itself): the run
directories of one setting, one per seed (the seed is read from each run's
config.yaml). The first group is the control. Printed as a Markdown table, one row
per group: the number of runs, test R@1 in both directions and rsum as mean ± std
over seeds; for every other group the rsum minus the control's rsum of the same
seed (mean ± std over the seeds both have) and on how many of those seeds the group
is ahead; and where the runs' objective logged them (GOAL does), the median positive
score, the median hardest-negative score and ``lam`` of the last logged training
step, averaged over seeds: where the scores ended up against ``lam``.
``--prefix itc_`` compares the test metrics of that prefix instead (X-VLM's
ITC-only recalls beside its re-ranked ones). A run without report.json
(unfinished) is an error that names it.
"""

from __future__ import annotations

import glob
import json
import statistics
import sys
from pathlib import Path

from mmgoal.cli.arguments import INPUT_ERRORS, print_error, tool_parser
from mmgoal.config import load_config
from mmgoal.files import MAX_ANNOTATION_BYTES, read_text, write_text

SCORE_KEYS = ("positive_median", "negative_median", "lam")


def read_run(run: Path) -> dict:
    """``{"seed", "test": {...}, "test_set", "last": {positive_median, negative_median, lam
    (those logged)}}`` of one run directory.

    Raises:
        FileNotFoundError: no report.json (an unfinished run).
        ValueError: a report without test metrics.
    """
    report_path = run / "report.json"
    if not report_path.is_file():
        raise FileNotFoundError(f"{run} has no report.json: the run has not finished "
                                f"(resume it, or leave it out of the glob)")
    report = json.loads(read_text(report_path, "run report"))
    if "test" not in report:
        raise ValueError(f"{run}/report.json has no test metrics: the run had no data.test "
                         f"split (evaluate its checkpoint with mmgoal eval, or leave "
                         f"it out of the glob)")
    config = load_config(run / "config.yaml")  # plain data, aliases bounded
    last: dict[str, float] = {}
    metrics = run / "metrics.jsonl"
    if metrics.is_file():
        for line in read_text(metrics, "metrics log", MAX_ANNOTATION_BYTES).splitlines():
            record = json.loads(line) if line.strip() else {}
            if record.get("type") == "train":
                last.update({k: record[k] for k in SCORE_KEYS if record.get(k) is not None})
    # the test set: the shard files the report names (names and sizes); a report written
    # before reports named them: the config's data.test.shards
    test_split = (config.get("data") or {}).get("test")
    test_set = ("files", report["test_set"]) if "test_set" in report else \
        ("config", test_split.get("shards")) if isinstance(test_split, dict) else None
    return {"seed": int(config.get("train", {}).get("seed", 0)), "test": report["test"],
            "test_set": test_set, "last": last, "dir": str(run)}


def same_test_set(test_set: tuple, other: tuple) -> bool:
    """Runs' ``("files", shard listing)`` or ``("config", shards)`` name one test set."""
    from mmgoal.data.remote import same_shards

    return (same_shards(test_set[1], other[1]) if test_set[0] == "files" else
            test_set == other)


def check_comparable(groups: list[tuple[str, list[dict]]]) -> None:
    """Every run was tested on the same test set, and no group has a seed twice.

    Raises:
        ValueError: naming the runs (or the group and seed) at fault.
    """
    for label, runs in groups:
        seeds = [r["seed"] for r in runs]
        twice = sorted({s for s in seeds if seeds.count(s) > 1})
        if twice:
            dirs = [r["dir"] for r in runs if r["seed"] == twice[0]]
            raise ValueError(f"group {label!r} has seed {twice[0]} more than once "
                             f"({', '.join(dirs)}): a paired difference needs one run per "
                             f"seed; narrow the glob")
    for kind in ("files", "config"):  # like with like: shard files, or config patterns
        known = [r for _, runs in groups for r in runs
                 if r["test_set"] is not None and r["test_set"][0] == kind]
        other = next((r for r in known if not same_test_set(r["test_set"], known[0]["test_set"])),
                     None)
        if other is not None:
            raise ValueError(f"{known[0]['dir']} and {other['dir']} were tested on different "
                             f"test sets ({known[0]['test_set'][1]} vs {other['test_set'][1]});"
                             f" their recalls are not comparable: evaluate both on one split "
                             f"with mmgoal eval, or leave one out")


def parse_group(spec: str) -> tuple[str, list[Path]]:
    label, sep, pattern = spec.partition("=")
    # a glob alone may itself contain '=' (grid point directories such as lam=0.5)
    if not sep or any(c in label for c in "/*"):
        label, pattern = spec, spec
    runs = sorted(Path(p) for p in glob.glob(pattern) if Path(p).is_dir())
    if not runs:
        raise FileNotFoundError(f"{spec}: no run directory matches {pattern!r}")
    return label, runs


def mean_std(values: list[float], digits: int = 1) -> str:
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def compare(groups: list[tuple[str, list[dict]]], prefix: str = "") -> str:
    """The Markdown table of :func:`main`; ``groups[0]`` is the control; the test
    metrics ``<prefix>i2t_r1``, ``<prefix>t2i_r1``, ``<prefix>rsum``."""
    i2t, t2i, rsum = (f"{prefix}{key}" for key in ("i2t_r1", "t2i_r1", "rsum"))
    control = {run["seed"]: run["test"][rsum] for run in groups[0][1]}
    lines = ["| setting | n | R@1 i2t | R@1 t2i | rsum | Δ rsum vs control (paired) | ahead "
             "| s_p median | s_n median | lam |", "|---|" + "---|" * 9]
    for index, (label, runs) in enumerate(groups):
        tests = [r["test"] for r in runs]
        cells = [label, str(len(runs)), mean_std([t[i2t] for t in tests]),
                 mean_std([t[t2i] for t in tests]), mean_std([t[rsum] for t in tests])]
        paired = [r["test"][rsum] - control[r["seed"]] for r in runs if r["seed"] in control]
        if index == 0 or not paired:
            cells += ["", ""]
        else:
            # recalls are multiples of 0.02: a difference under 1e-6 is a tie (float sums)
            cells += [f"{mean_std(paired)} (n={len(paired)})",
                      f"{sum(d > 1e-6 for d in paired)}/{len(paired)}"]
        for key in SCORE_KEYS:
            values = [r["last"][key] for r in runs if key in r["last"]]
            cells.append(mean_std(values, 2) if len(values) == len(runs) else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = tool_parser(__doc__)
    parser.add_argument("groups", nargs="+", metavar="LABEL=GLOB",
                        help="run directories of one setting; the first is the control")
    parser.add_argument("--prefix", default="", help="compare the test metrics of this "
                        "prefix, e.g. itc_ (X-VLM's ITC-only recalls)")
    parser.add_argument("--out", help="also write the table to this Markdown file")
    args = parser.parse_args(argv)
    try:
        groups = [(label, [read_run(run) for run in runs])
                  for label, runs in map(parse_group, args.groups)]
        check_comparable(groups)
    except INPUT_ERRORS as error:  # JSONDecodeError is a ValueError
        return print_error(error)
    try:
        table = compare(groups, args.prefix)
    except KeyError as error:
        return print_error(f"a run's report.json has no test metric {error}; check --prefix")
    if args.out:
        write_text(args.out, table)
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
