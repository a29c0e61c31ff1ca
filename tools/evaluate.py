"""``python tools/evaluate.py ARGS``, from a clone, is ``mmgoal eval ARGS``
(mmgoal/cli/evaluate.py; docs/getting_started.md)."""

import sys

from mmgoal.cli.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
