"""``python tools/finetune.py ARGS``, from a clone, is ``mmgoal train ARGS``
(mmgoal/cli/train.py; docs/getting_started.md)."""

import sys

from mmgoal.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
