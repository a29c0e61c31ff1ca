"""Progress bars as every tool draws them: on a terminal only, since a redirected log would
fill with their carriage-return updates (a run's log lines say the same there)."""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm


def progress_bar(iterable: Any = None, show: bool = True, **options: Any) -> tqdm:
    """``tqdm(iterable, **options)``, drawn where ``show`` and stderr is a terminal."""
    # tqdm's disable=None: off where its output is not a terminal
    return tqdm(iterable, disable=None if show else True, **options)


def bars_drawn(show: bool) -> bool:
    """Whether :func:`progress_bar` draws with ``show`` (else a run logs its steps)."""
    return show and sys.stderr.isatty()
