"""``python tools/search.py ARGS``, from a clone, is ``mmgoal search ARGS``
(mmgoal/cli/search.py; docs/getting_started.md)."""

import sys

from mmgoal.cli.search import main

if __name__ == "__main__":
    sys.exit(main())
