"""Old import paths keep working for one release, warn once, and give the new objects."""

import importlib
import subprocess
import sys
import warnings

import pytest

MOVED = {
    "mmgoal.engine.checkpoint": ("mmgoal.runs.checkpoint", "load_checkpoint"),
    "mmgoal.engine.schema": ("mmgoal.runs.schema", "load_run_config"),
    "mmgoal.engine.run_dir": ("mmgoal.runs.run_dir", "weights_file"),
    "mmgoal.engine.gather": ("mmgoal.distributed", "gather_features"),
    "mmgoal.data.preprocessing": ("mmgoal.runs.preprocessing", "resolve_preprocessing"),
    "mmgoal.evaluation.loading": ("mmgoal.runs.loading", "load_for_evaluation"),
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_warns_once_and_gives_the_new_object(old):
    new, name = MOVED[old]
    alias = importlib.reload(importlib.import_module(old))  # a fresh "warned once" state
    with pytest.warns(DeprecationWarning, match=rf"{old} moved to {new}: import {name} from "
                                                rf"{new} \(the old path goes in mmgoal 0.2"):
        value = getattr(alias, name)
    assert value is getattr(importlib.import_module(new), name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second name: no second warning
        exec(f"from {old} import {name}", {})
    with pytest.raises(AttributeError, match=rf"module '{old}' \(now '{new}'\) has no "
                                             rf"attribute 'no_such_name'"):
        alias.no_such_name  # noqa: B018


def test_importing_mmgoal_loads_no_old_path():
    # the package registers everything without touching an alias: no warning for users
    code = ("import sys, warnings; warnings.simplefilter('error'); import mmgoal; "
            f"print(sorted(m for m in {sorted(MOVED)!r} if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "[]"
