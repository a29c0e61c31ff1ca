"""``python tools/wise_ft.py ARGS``, from a clone, is ``mmgoal wise-ft ARGS``
(mmgoal/cli/wise_ft.py; docs/models.md)."""

import sys

from mmgoal.cli.wise_ft import main

if __name__ == "__main__":
    sys.exit(main())
