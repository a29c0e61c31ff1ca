"""``python tools/make_shards.py ARGS``, from a clone, is ``mmgoal make-shards ARGS``
(mmgoal/cli/make_shards.py; docs/getting_started.md)."""

import sys

from mmgoal.cli.make_shards import main

if __name__ == "__main__":
    sys.exit(main())
