"""``python -m mmgoal``: the ``mmgoal`` command (``torchrun ... -m mmgoal train CONFIG``)."""

import sys

from mmgoal.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
