"""``python tools/compare_runs.py ARGS``, from a clone, is ``mmgoal compare-runs ARGS``
(mmgoal/cli/compare_runs.py; docs/getting_started.md)."""

import sys

from mmgoal.cli.compare_runs import main

if __name__ == "__main__":
    sys.exit(main())
