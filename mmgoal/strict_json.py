"""JSON that every strict parser reads: NaN and infinities are written as ``null``.

Python's ``json`` writes ``NaN`` and ``-Infinity``, which jq, ``JSON.parse`` and Go refuse.
Every JSON file mmgoal writes as a result or record goes through :func:`dumps`; a ``null``
where a number stood means "none" (a diverged loss). A shard sample's ``json`` member is
not such a file: plain ``json.dumps``, read back by Python.
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
