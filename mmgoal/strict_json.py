"""JSON that every strict parser reads: NaN and infinities are written as ``null``.

Python's ``json`` writes ``NaN`` and ``-Infinity``, which JSON does not have (jq,
JavaScript's ``JSON.parse`` and Go refuse them); every JSON file mmgoal writes
(``report.json``, ``metrics.jsonl``, an evaluation's ``--out``, a sweep's
``runs.json``, an export's metadata) goes through :func:`dumps`. A ``null`` where a
number stood means "none": a diverged loss, or the best validation rsum of a run
that never validated.
"""

from __future__ import annotations

import json
import math
from typing import Any


def finite(value: Any) -> Any:
    """``value`` with every non-finite float (in dicts, lists and tuples) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    return value


def dumps(value: Any, **options: Any) -> str:
    """``json.dumps`` of :func:`finite` ``(value)``, refusing any NaN left (``allow_nan=False``)."""
    return json.dumps(finite(value), allow_nan=False, **options)
