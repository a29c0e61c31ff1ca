"""``python tools/plot_attention.py ARGS``, from a clone, is ``mmgoal plot-attention ARGS``
(mmgoal/cli/plot_attention.py; docs/getting_started.md)."""

import sys

from mmgoal.cli.plot_attention import main

if __name__ == "__main__":
    sys.exit(main())
