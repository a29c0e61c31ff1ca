"""JSON that every strict parser reads: NaN and infinities are written as ``null``.

Python's ``json`` writes ``NaN`` and ``-Infinity``, which JSON does not have (jq,
JavaScript's ``JSON.parse`` and Go refuse them). The JSON files mmgoal writes as its
results and records go through :func:`dumps`: ``report.json``, ``metrics.jsonl``, an
evaluation's ``--out`` and ``--rankings``, a sweep's ``runs.json``, ``mmgoal
inspect-shards --json``, an export's manifest, the state in a checkpoint's metadata,
``wise_ft.json``, a synthetic benchmark's ``meta.json``, a conversion's ``summary.json``
and shard stats. A ``null`` where a number stood means "none": a diverged loss, or the
best validation rsum of a run that never validated. The ``json`` member of a shard's
sample is not a file of its own: it is written with plain ``json.dumps`` and read
back with Python's ``json``.
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
