"""``python tools/plot_curves.py ARGS``, from a clone, is ``mmgoal plot-curves ARGS``
(mmgoal/cli/plot_curves.py; docs/getting_started.md)."""

import sys

from mmgoal.cli.plot_curves import main

if __name__ == "__main__":
    sys.exit(main())
