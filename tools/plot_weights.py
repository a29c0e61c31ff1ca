"""``python tools/plot_weights.py ARGS``, from a clone, is ``mmgoal plot-weights ARGS``
(mmgoal/cli/plot_weights.py; docs/getting_started.md)."""

import sys

from mmgoal.cli.plot_weights import main

if __name__ == "__main__":
    sys.exit(main())
