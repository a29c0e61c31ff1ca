import sys
import textwrap

import pytest
import torch

import mmgoal  # noqa: F401  (registers the built-ins)
from mmgoal import registry
from mmgoal.registry import Registry


def test_unknown_name_lists_available_and_closest():
    reg = Registry("widget")

    @reg.register()
    class TripletLoss:
        pass

    @reg.register()
    class CircleLoss:
        pass

    with pytest.raises(KeyError) as info:
        reg.get("TripletLos")
    message = str(info.value)
    assert "'TripletLos' is not in the widget registry" in message
    assert "Did you mean 'TripletLoss'?" in message
    assert "Available: CircleLoss, TripletLoss." in message


def test_unknown_name_without_close_match_has_no_guess():
    reg = Registry("widget")
    reg.register("Alpha")(dict)
    with pytest.raises(KeyError) as info:
        reg.get("zzzzzz")
    assert "Did you mean" not in str(info.value)
    assert "Available: Alpha" in str(info.value)


def test_duplicates_are_refused_unless_forced():
    reg = Registry("widget")
    reg.register("A")(dict)
    with pytest.raises(KeyError, match="already registered"):
        reg.register("A")(list)
    reg.register("A", force=True)(list)
    assert reg.get("A") is list


def test_build_passes_kwargs_and_reports_unknown_and_missing_keys():
    reg = Registry("widget")

    @reg.register()
    class Box:
        def __init__(self, width, height=1, tokenizer=None):
            self.width, self.height, self.tokenizer = width, height, tokenizer

    box = reg.build({"type": "Box", "width": 3}, tokenizer="tok", unrelated="x")
    assert (box.width, box.height, box.tokenizer) == (3, 1, "tok")
    # the config wins over the context
    assert reg.build({"type": "Box", "width": 3, "tokenizer": "mine"}, tokenizer="tok").tokenizer \
        == "mine"
    with pytest.raises(TypeError) as info:
        reg.build({"type": "Box", "width": 3, "hieght": 2})
    assert "'hieght' (did you mean 'height'?)" in str(info.value)
    assert "accepts: width, height, tokenizer" in str(info.value)
    with pytest.raises(TypeError, match="needs config key"):
        reg.build({"type": "Box"})
    with pytest.raises(TypeError, match="mapping with a 'type' key"):
        reg.build({"width": 3})


def test_custom_imports_register_user_components(tmp_path, monkeypatch):
    (tmp_path / "my_objectives.py").write_text(textwrap.dedent("""
        from mmgoal.registry import OBJECTIVES

        @OBJECTIVES.register()
        class MyObjective:
            def __init__(self, scale=1.0):
                self.scale = scale
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.import_custom_modules(["my_objectives"])
    try:
        assert registry.OBJECTIVES.build({"type": "MyObjective", "scale": 2.0}).scale == 2.0
    finally:
        registry.OBJECTIVES._entries.pop("MyObjective", None)
        sys.modules.pop("my_objectives", None)
    with pytest.raises(ImportError, match="custom_imports lists 'no_such_module_xyz'"):
        registry.import_custom_modules(["no_such_module_xyz"])


def test_entry_point_plugins_are_loaded_on_a_miss(monkeypatch):
    loaded = []

    class FakeEntryPoint:
        name = "fake"

        def load(self):
            registry.HOOKS.register("PluginHook")(dict)
            loaded.append(True)

    monkeypatch.setattr(registry, "_plugins_loaded", False)
    monkeypatch.setattr(registry.metadata, "entry_points",
                        lambda group: [FakeEntryPoint()] if group == "mmgoal.plugins" else [])
    try:
        assert registry.HOOKS.get("PluginHook") is dict
        assert loaded == [True]
    finally:
        registry.HOOKS._entries.pop("PluginHook", None)


def test_every_registry_lives_in_registry_module():
    names = {"MODELS", "ENCODERS", "POOLERS", "OBJECTIVES", "CONSTRAINTS", "DATASETS",
             "TOKENIZERS", "TRANSFORMS", "HOOKS", "STRATEGIES"}
    assert names <= {n for n, v in vars(registry).items() if isinstance(v, Registry)}


def test_context_reaches_named_parameters_only():
    reg = Registry("thing")

    @reg.register()
    class Named:
        def __init__(self, size=1, tokenizer=None):
            self.size, self.tokenizer = size, tokenizer

    @reg.register()
    class Inherited(torch.nn.Module):  # no __init__ of its own: Module(*args, **kwargs)
        pass

    assert reg.build({"type": "Named"}, tokenizer="tok").tokenizer == "tok"
    assert reg.build({"type": "Named", "tokenizer": "mine"}, tokenizer="tok").tokenizer == "mine"
    assert isinstance(reg.build({"type": "Inherited"}, tokenizer="tok"), Inherited)


EAGER_REGISTRATION = """
import importlib, json, pkgutil
import mmgoal
from mmgoal import registry
for module in pkgutil.walk_packages(mmgoal.__path__, "mmgoal."):
    importlib.import_module(module.name)
tables = {}
for name in dir(registry):
    found = getattr(registry, name)
    if isinstance(found, registry.Registry):
        tables[name] = {"registered": {key: found.origin(key) for key in found._entries},
                        "locations": found.locations}
print(json.dumps(tables))
"""


def test_the_location_tables_are_what_importing_every_module_registers():
    """Each registry's table of built-ins (the module a name's lookup imports) is exactly what
    importing every module of mmgoal registers, and where."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", EAGER_REGISTRATION], capture_output=True,
                         text=True, check=True).stdout
    tables = json.loads(out)
    assert len(tables) == 19
    for name, table in tables.items():
        assert table["registered"] == table["locations"], name


FRONT_DOOR = """
import sys
import mmgoal
heavy = ("torch", "timm", "wandb", "deepspeed", "accelerate", "torchvision.ops",
         "torch._dynamo")
print([m for m in heavy if m in sys.modules])
from mmgoal.registry import OBJECTIVES
print(sorted(m for m in sys.modules if m.startswith("mmgoal.objectives.")))
OBJECTIVES.get("TripletLoss")
print(sorted(m for m in sys.modules if m.startswith("mmgoal.objectives.")))
print("TripletLoss" in OBJECTIVES, "GoalObjective" in OBJECTIVES,
      len(OBJECTIVES) == len(OBJECTIVES.locations) > 10)
"""


def test_import_mmgoal_is_light_and_a_name_loads_its_module_when_asked():
    import subprocess
    import sys

    lines = subprocess.run([sys.executable, "-c", FRONT_DOOR], capture_output=True,
                           text=True, check=True).stdout.splitlines()
    assert lines[0] == "[]"  # none of the heavy modules, not even torch
    assert lines[1] == "[]"
    assert "'mmgoal.objectives.triplet'" in lines[2]
    assert "'mmgoal.objectives.goal'" not in lines[2]  # only what the name needed
    assert lines[3] == "True True True"  # built-ins not yet imported are known by name
