"""``python tools/export.py ARGS``, from a clone, is ``mmgoal export ARGS``
(mmgoal/cli/export.py; docs/getting_started.md)."""

import sys

from mmgoal.cli.export import main

if __name__ == "__main__":
    sys.exit(main())
