"""``python tools/sweep.py ARGS``, from a clone, is ``mmgoal sweep ARGS``
(mmgoal/cli/sweep.py; docs/getting_started.md)."""

import sys

from mmgoal.cli.sweep import main

if __name__ == "__main__":
    sys.exit(main())
