"""``python tools/score_stats.py ARGS``, from a clone, is ``mmgoal score-stats ARGS``
(mmgoal/cli/score_stats.py; docs/getting_started.md)."""

import sys

from mmgoal.cli.score_stats import main

if __name__ == "__main__":
    sys.exit(main())
