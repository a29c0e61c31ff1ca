"""What a file someone sends a user can make mmgoal do (docs/configs.md, "What a received file
can make mmgoal do"): no code runs from it, nothing it names is imported unless the user
asks, and it cannot make mmgoal allocate what it does not hold."""

import json
import logging
import sys
import time
import tracemalloc

import pytest
import torch
import yaml
from payloads import WritesMarker, marker_module
from script_modules import ROOT, load_tool

import mmgoal
from mmgoal.config import MAX_EXPANDED_VALUES, load_config
from mmgoal.registry import MODELS
from mmgoal.runs import checkpoint
from mmgoal.runs.checkpoint import load_checkpoint, save_safetensors


def received_export(run, folder, **config_changes):
    """The run's best weights as an export whose stored config says ``config_changes``."""
    state = load_checkpoint(run / "checkpoints" / "best.pt")
    config = {**state["config"], **config_changes}
    path = folder / "received.safetensors"
    save_safetensors({"model": state["model"], "tokenizer": state["tokenizer"],
                      "config": config, "epoch": 0, "exported_from": "elsewhere"}, path)
    return path


TINY_CLIP = {"embed_dim": 16,
             "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 16,
                            "head_width": 16},
             "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2,
                          "layers": 1}}


def test_a_config_cannot_switch_off_weights_only_loading(tmp_path):
    open_clip = pytest.importorskip("open_clip")
    (tmp_path / "received-tiny.json").write_text(json.dumps(TINY_CLIP))
    open_clip.add_model_config(tmp_path / "received-tiny.json")
    marker = tmp_path / "code-ran"
    torch.save({"state_dict": WritesMarker(marker)}, tmp_path / "evil.pt")
    section = {"type": "OpenCLIP", "model_name": "received-tiny",
               "pretrained": str(tmp_path / "evil.pt"), "model_kwargs": {"weights_only": False}}
    with pytest.raises(ValueError, match=r"model_kwargs: 'weights_only' is not an architecture "
                                         r"key \(model_kwargs takes embed_dim, .*vision_cfg\); "
                                         r"how weights are read is not a config's to say"):
        MODELS.build(section)
    config = tmp_path / "clip.yaml"
    config.write_text(yaml.safe_dump({"model": section}))
    with pytest.raises(ValueError, match="'weights_only' is not an architecture key"):
        mmgoal.from_config(config, device="cpu")
    # every loading switch of create_model is refused, not only weights_only
    for switch in ("pretrained_image_path", "cache_dir", "load_weights"):
        with pytest.raises(ValueError, match=f"'{switch}' is not an architecture key"):
            MODELS.build({**section, "model_kwargs": {switch: "x"}})
    # architecture keys still go through; the planted pickle is refused by the weights-only
    # reader
    with pytest.raises(Exception, match="(?i)weights.only|unpickl"):
        MODELS.build({**section, "model_kwargs": {"embed_dim": 16}})
    assert not marker.exists()


def test_an_export_never_imports_what_its_config_names(tiny_quickstart_run, tmp_path,
                                                       monkeypatch, caplog):
    run, _ = tiny_quickstart_run
    marker = tmp_path / "imported"
    marker_module(tmp_path, "payload_module", marker)
    monkeypatch.syspath_prepend(str(tmp_path))  # as the current folder is for `python -c`
    monkeypatch.delitem(sys.modules, "payload_module", raising=False)
    export = received_export(run, tmp_path, custom_imports=["payload_module"])
    with caplog.at_level(logging.WARNING):
        retriever = mmgoal.load(export, device="cpu")
    assert not marker.exists()
    assert "lists custom_imports payload_module; they were not imported" in caplog.text
    assert retriever.encode_texts(["a red circle"]).shape == (1, 16)  # the model still loads
    # the evaluation tool, on the export and on a run folder whose config names it
    evaluate = load_tool("eval")
    assert evaluate.main([str(export), "--device", "cpu"]) == 0
    assert not marker.exists()
    # asked for, the modules are imported, and the log says which, from where
    with caplog.at_level(logging.INFO):
        mmgoal.load(export, device="cpu", trust_custom_imports=True)
    assert marker.exists()
    assert f"custom_imports: imported payload_module from {tmp_path / 'payload_module.py'}" \
        in caplog.text


def test_a_component_only_an_untrusted_module_registers_says_how_to_allow_it(
        tiny_quickstart_run, tmp_path):
    run, _ = tiny_quickstart_run
    export = received_export(run, tmp_path, custom_imports=["somebodys_plugin"],
                             objective={"type": "SomebodysLoss"})
    with pytest.raises(KeyError, match=r"'SomebodysLoss' is not in the objective registry.*The "
                                       r"config's custom_imports \(somebodys_plugin\) were not "
                                       r"imported: .*--trust-custom-imports"):
        mmgoal.load(export, device="cpu")


def test_printing_a_received_config_imports_nothing(tmp_path, capsys):
    marker = tmp_path / "imported"
    marker_module(tmp_path, "beside_payload", marker)
    config = tmp_path / "config.yaml"
    config.write_text(f"_base_: {ROOT / 'configs/quickstart.yaml'}\n"
                      f"custom_imports: [beside_payload]\n")
    finetune = load_tool("train")
    assert finetune.main([str(config), "--print-config"]) == 0
    assert not marker.exists()
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["custom_imports"] == ["beside_payload"]
    assert finetune.main([str(config), "--print-config", "--trust-custom-imports"]) == 0
    assert marker.exists()


def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path):
    # 9 levels of 10 aliases: 10**9 values from a few hundred bytes
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 9)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(lines) + "\n")
    tracemalloc.start()
    start = time.perf_counter()
    with pytest.raises(ValueError, match=rf"bomb.yaml \({len(bomb.read_text())} bytes\) expands "
                                         rf"through YAML aliases .* to more than "
                                         rf"{MAX_EXPANDED_VALUES} values"):
        load_config(bomb)
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 50 * 2**20 and seconds < 30  # refused without building it (not a benchmark)
    # aliases that stay small are plain YAML, shared values copied out
    fine = tmp_path / "fine.yaml"
    fine.write_text("a: &x {b: 1}\nc: *x\nd: [*x, *x]\n")
    assert load_config(fine) == {"a": {"b": 1}, "c": {"b": 1}, "d": [{"b": 1}, {"b": 1}]}


def test_an_export_claiming_a_huge_model_is_refused_before_allocating_it(tiny_quickstart_run,
                                                                         tmp_path, monkeypatch):
    run, _ = tiny_quickstart_run
    state = load_checkpoint(run / "checkpoints" / "best.pt")
    # 20e6 x 16 float32 values (1.2 GiB) in the projection alone, from a file of 100 KiB
    export = received_export(run, tmp_path,
                             model={**state["config"]["model"], "embed_dim": 20_000_000})
    assert export.stat().st_size < 2**20
    checked = []
    check_same_model = checkpoint.check_same_model
    monkeypatch.setattr(checkpoint, "check_same_model", lambda model, *args: checked.append(
        next(model.parameters()).device.type) or check_same_model(model, *args))
    with pytest.raises(ValueError, match=r"does not fit the model this config builds .*shapes "
                                         r"differ: image_proj.bias \(16,\) vs \(20000000,\)"):
        mmgoal.load(export, device="cpu")
    assert checked == ["meta"]  # refused on the meta device: the real model was never built


def test_a_trusted_custom_import_that_is_missing_is_a_sentence(tiny_quickstart_run, tmp_path,
                                                               capsys):
    run, _ = tiny_quickstart_run
    export = received_export(run, tmp_path, custom_imports=["no_such_plugin_module"])
    evaluate = load_tool("eval")
    assert evaluate.main([str(export), "--device", "cpu", "--trust-custom-imports"]) == 2
    err = capsys.readouterr().err
    assert "error: custom_imports lists 'no_such_plugin_module', which cannot be imported" in err
    assert "Traceback" not in err
