"""The rooms of the house: every import inside mmgoal/ keeps the layering of docs/architecture.md.

Each file belongs to a layer; a layer may import its own modules and those of the layers
it lists, nothing else. The imports are read with ``ast`` from every file, including the
ones inside functions and ``TYPE_CHECKING`` blocks, so a lazy import cannot hide a
dependency the layering forbids.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mmgoal"

CORE = {"config", "registry", "paths", "sequences", "extras", "devices", "distributed",
        "strict_json", "console"}
# layer -> the layers its modules may import (besides their own); files.py, the bottom, every
# layer but the package's __init__ may import (below)
MAY_IMPORT = {
    "files": set(),  # how mmgoal reads and writes a file: imports nothing of mmgoal
    "config": set(),  # config and registry import nothing of mmgoal but each other
    "registry": {"config"},
    "core": {"config", "registry", "core"},
    "structures": {"config", "registry", "core"},
    "data": {"config", "registry", "core", "structures"},
    "models": {"config", "registry", "core", "structures"},
    "objectives": {"config", "registry", "core", "structures"},
    "runs": {"config", "registry", "core", "structures", "data"},
    "evaluation": {"config", "registry", "core", "structures", "data", "models", "runs"},
    "api": {"config", "registry", "core", "structures", "data", "models", "runs",
            "evaluation"},
    # the trainer reads mmgoal.__version__ from the package itself
    "engine": {"config", "registry", "core", "structures", "data", "models", "objectives",
               "runs", "evaluation", "package"},
    # mmgoal/__init__.py imports nothing of mmgoal: its API comes when first asked for
    "package": set(),
    # what the command-line tools share; nothing in the package imports it
    "cli": {"config", "registry", "core", "structures", "data", "models", "objectives",
            "runs", "evaluation", "engine", "api", "package"},
}
for _layer, _imports in MAY_IMPORT.items():
    if _layer not in ("files", "package"):
        _imports.add("files")


def layer_of(module: str) -> str:
    """The layer of a dotted module name inside mmgoal (``mmgoal.runs.schema`` -> ``runs``)."""
    parts = module.split(".")
    if parts == ["mmgoal"]:
        return "package"
    top = parts[1]
    if top in ("config", "registry", "files"):
        return top
    if top in CORE:
        return "core"
    if top in ("structures", "contract", "scoring"):
        return "structures"
    if top in ("data", "models", "objectives", "runs", "evaluation", "engine", "api", "cli"):
        return top
    if top == "__main__":  # python -m mmgoal: the mmgoal command
        return "cli"
    raise AssertionError(f"mmgoal.{top} is in no layer: add it to tests/test_layering.py and "
                         f"docs/architecture.md")


def module_name(path: Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def mmgoal_imports(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every import of an mmgoal module in ``path``; ``from mmgoal
    import data`` counts as ``mmgoal.data``."""
    tree = ast.parse(path.read_text(), str(path))
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's package upwards
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            if base == "mmgoal":
                found += [(node.lineno, f"mmgoal.{alias.name}") for alias in node.names
                          if alias.name != "__version__"] or [(node.lineno, "mmgoal")]
            else:
                found.append((node.lineno, base))
    return [(line, name) for line, name in found if name.split(".")[0] == "mmgoal"]


def files():
    return sorted(PACKAGE.rglob("*.py"))


def violations() -> list[str]:
    broken = []
    for path in files():
        own = layer_of(module_name(path))
        for line, target in mmgoal_imports(path):
            wanted = layer_of(target)
            if wanted != own and wanted not in MAY_IMPORT[own]:
                broken.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({own}) imports "
                              f"{target} ({wanted})")
    return broken


def test_every_import_keeps_the_layering():
    assert violations() == [], ("imports that break the layering of docs/architecture.md "
                                "(move the piece down a layer rather than import upward):\n"
                                + "\n".join(violations()))


def test_the_rules_the_architecture_page_states():
    # objectives never import the engine, a model or data; models never the engine or data; data
    # never models, the engine or evaluation; evaluation and the API never the engine
    forbidden = {"objectives": {"engine", "models", "data"}, "models": {"engine", "data"},
                 "data": {"models", "engine", "evaluation"}, "evaluation": {"engine"},
                 "api": {"engine"}, "runs": {"engine", "evaluation"}}
    for layer, never in forbidden.items():
        assert not never & MAY_IMPORT[layer], layer
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    for layer in MAY_IMPORT:
        if layer not in ("config", "registry", "package"):
            assert f"`{layer}`" in page, f"docs/architecture.md does not name the {layer} layer"


def test_the_checker_sees_imports_inside_functions_and_relative_ones(tmp_path, monkeypatch):
    # a lazy import upward is still an import: the walk finds it
    fake = tmp_path / "mmgoal" / "models"
    fake.mkdir(parents=True)
    (fake / "lazy.py").write_text("def f():\n    from mmgoal.engine.trainer import Trainer\n"
                                  "    from ..data import pipeline\n")
    monkeypatch.setitem(globals(), "PACKAGE", tmp_path / "mmgoal")
    assert mmgoal_imports(fake / "lazy.py") == [(2, "mmgoal.engine.trainer"),
                                                (3, "mmgoal.data")]
    assert violations() == [
        "mmgoal/models/lazy.py:2 (models) imports mmgoal.engine.trainer (engine)",
        "mmgoal/models/lazy.py:3 (models) imports mmgoal.data (data)"]
