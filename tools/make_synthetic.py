"""``python tools/make_synthetic.py ARGS``, from a clone, is ``mmgoal make-synthetic ARGS``
(mmgoal/cli/make_synthetic.py; docs/getting_started.md)."""

import sys

from mmgoal.cli.make_synthetic import main

if __name__ == "__main__":
    sys.exit(main())
