"""``python tools/inspect_shards.py ARGS``, from a clone, is ``mmgoal inspect-shards ARGS``
(mmgoal/cli/inspect_shards.py; docs/getting_started.md)."""

import sys

from mmgoal.cli.inspect_shards import main

if __name__ == "__main__":
    sys.exit(main())
