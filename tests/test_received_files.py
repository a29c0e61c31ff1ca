"""What a file someone sends a user can make mmgoal do (docs/received_files.md): no code
runs from it, no command or request leaves for the data paths it names, nothing it names is
imported unless the user asks, nothing is written through its links, and it cannot make
mmgoal allocate what it does not hold."""

import json
import logging
import sys
import time
import tracemalloc

import pytest
import torch
import yaml
from payloads import WritesMarker, checked_devices, marker_module
from script_modules import ROOT, load_tool

import mmgoal
import mmgoal.runs.schema
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
    # mmgoal export copies the weights without building the model: it says so all the same
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert load_tool("export").main([str(export), "--out", str(tmp_path / "re.pt")]) == 0
    assert not marker.exists()
    assert f"{export} lists custom_imports payload_module; they were not imported" in \
        caplog.text
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
                             model={"type": "SomebodysModel"})
    with pytest.raises(KeyError, match=r"'SomebodysModel' is not in the model registry.*The "
                                       r"config's custom_imports \(somebodys_plugin\) were not "
                                       r"imported: .*--trust-custom-imports"):
        mmgoal.load(export, device="cpu")
    # a section evaluation never builds (the objective) is not checked, nor imported for
    export = received_export(run, tmp_path, custom_imports=["somebodys_plugin"],
                             objective={"type": "SomebodysLoss"})
    assert mmgoal.load(export, device="cpu").model is not None


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
    checked = checked_devices(monkeypatch)
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


def with_shards(run, folder, name, shards, suffix=".pt"):
    """The run's best checkpoint, received as ``name``: its stored config's val and test
    shards are ``shards``."""
    state = load_checkpoint(run / "checkpoints" / "best.pt")
    data = state["config"]["data"]
    config = {**state["config"], "data": {**data, "val": {**data["val"], "shards": shards},
                                          "test": {**data["test"], "shards": shards}}}
    path = folder / name
    if suffix == ".safetensors":
        return received_export(run, folder, data=config["data"])
    checkpoint.save_checkpoint({**state, "config": config}, path)
    return path


def test_a_stored_pipe_command_never_runs_unless_the_user_says_so(tiny_quickstart_run,
                                                                  tmp_path, capsys):
    run, out = tiny_quickstart_run
    marker = tmp_path / "PWNED"
    planted = f"pipe:sh -c 'touch {marker}; cat {out}/test-000000.tar'"
    got = with_shards(run, tmp_path, "GOT.pt", planted)
    export = with_shards(run, tmp_path, "X", planted, suffix=".safetensors")
    got_run = tmp_path / "GOTRUN" / "checkpoints"
    got_run.mkdir(parents=True)
    got.rename(got_run / "best.pt")
    evaluate, score_stats = load_tool("eval"), load_tool("score-stats")
    refused = f"would run the command \"sh -c 'touch {marker}; cat {out}/test-000000.tar'\""
    for tool, argv, key, source in (
            (evaluate, [str(got_run.parent), "--split", "val"], "data.val.shards",
             f"the config stored in {got_run / 'best.pt'}"),
            (evaluate, [str(export)], "data.test.shards", f"the config stored in {export}"),
            (score_stats, [str(got_run / "best.pt")], "data.test.shards",
             f"the config stored in {got_run / 'best.pt'}")):
        assert tool.main([*argv, "--device", "cpu"] if tool is evaluate else argv) == 2
        err = capsys.readouterr().err
        assert f"{key} of {source} {refused}; mmgoal runs no command and fetches no URL " \
               f"that a received file names. If you trust the file, pass " \
               f"--trust-data-paths; or give the shards yourself (--shards PATTERN, or " \
               f"--cfg-options {key}=...)" in err
        assert not marker.exists()
    # the shards given again on the command line are read; the stored command is not run
    local = tmp_path / "local.json"
    assert evaluate.main([str(export), "--device", "cpu", "--shards",
                          f"{out}/test-000000.tar", "--out", str(local)]) == 0
    assert not marker.exists()
    # the user's word runs it, and it feeds the same shard
    trusted = tmp_path / "trusted.json"
    assert evaluate.main([str(export), "--device", "cpu", "--trust-data-paths",
                          "--out", str(trusted)]) == 0
    assert marker.exists()
    assert json.loads(trusted.read_text())["metrics"] == json.loads(local.read_text())["metrics"]


def test_a_received_config_does_not_run_its_pipe_shards_in_a_zero_shot_evaluation(
        tiny_benchmark, tmp_path, capsys):
    open_clip = pytest.importorskip("open_clip")
    out, _ = tiny_benchmark
    marker = tmp_path / "PWNED"
    base = ROOT / "configs" / "clip" / "clip_tiny_synthetic.yaml"
    kwargs = mmgoal.runs.schema.load_model_config(base)["model"]["model_kwargs"]
    weights = tmp_path / "pretrained.pt"
    torch.save(open_clip.create_model("ViT-B-32", **kwargs).state_dict(), weights)
    got = tmp_path / "GOT.yaml"
    got.write_text(yaml.safe_dump({
        "_base_": str(base), "model": {"pretrained": str(weights)},
        "data": {"test": {"shards": f"pipe:sh -c 'touch {marker}; cat "
                                    f"{out}/test-000000.tar'"}}}))
    evaluate = load_tool("eval")
    assert evaluate.main([str(got), "--device", "cpu"]) == 2
    assert f"data.test.shards of config {got} would run the command" in capsys.readouterr().err
    assert not marker.exists()
    # --cfg-options naming the shards is the user's own word for them
    assert evaluate.main([str(got), "--device", "cpu", "--cfg-options",
                          f"data.test.shards={out}/test-000000.tar"]) == 0
    assert not marker.exists()


def test_a_stored_remote_url_is_never_requested_unless_the_user_says_so(tiny_quickstart_run,
                                                                        tmp_path, capsys):
    from hub_server import serving

    run, out = tiny_quickstart_run
    evaluate = load_tool("eval")
    with serving() as server:
        server.folder = out
        url = f"{server.url}/files/test-000000.tar"
        got = with_shards(run, tmp_path, "GOT.pt", url)
        assert evaluate.main([str(got), "--device", "cpu"]) == 2
        assert f"data.test.shards of the config stored in {got} would fetch {url}; " in \
            capsys.readouterr().err
        assert server.requests == []  # no beacon, no request into the user's network
        remote, local = tmp_path / "remote.json", tmp_path / "local.json"
        assert evaluate.main([str(got), "--device", "cpu", "--trust-data-paths",
                              "--out", str(remote)]) == 0
        assert server.requests == [("GET", "/files/test-000000.tar")]
    assert evaluate.main([str(got), "--device", "cpu", "--shards", f"{out}/test-000000.tar",
                          "--out", str(local)]) == 0
    assert json.loads(remote.read_text())["metrics"] == json.loads(local.read_text())["metrics"]


def test_a_file_a_glob_matches_is_read_as_a_file_whatever_its_name(tmp_path, monkeypatch):
    from mmgoal.data.pipeline import EvalReader, expand_shards, iter_eval_batches
    from mmgoal.data.shards import ShardWriter
    from mmgoal.data.transforms import build_transforms

    marker = tmp_path / "PWNED"
    with ShardWriter(tmp_path, "s", max_count=4) as writer:
        for key in range(3):
            writer.write({"__key__": str(key), "json": json.dumps(
                {"image_id": key, "captions": ["a"]}).encode(), "png": png_bytes()})
    named = tmp_path / f"pipe:touch {marker.name}; cat s-000000.tar"
    (tmp_path / "s-000000.tar").rename(named)
    monkeypatch.chdir(tmp_path)
    assert expand_shards("pipe*") == [f"./{named.name}"]
    ids = [i for b in iter_eval_batches(EvalReader("pipe*", 4), build_transforms(None, 8))
           for i in b["image_ids"]]
    assert ids == [0, 1, 2] and not marker.exists()


def png_bytes():
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 0, 0)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_an_evaluation_whose_split_cannot_be_read_whole_gives_no_metrics(tiny_quickstart_run,
                                                                         tmp_path, capsys):
    from hub_server import serving

    run, out = tiny_quickstart_run
    evaluate = load_tool("eval")
    metrics = tmp_path / "metrics.json"
    with serving() as server:
        server.folder = out
        server.fail["/files/test-000001.tar"] = 404  # every time
        failing = f"{server.url}/files/test-000001.tar"
        assert evaluate.main([str(run), "--device", "cpu", "--out", str(metrics), "--shards",
                              f"{out}/test-000000.tar", failing]) == 1
    err = capsys.readouterr().err
    assert f"error: shard {failing} could not be read after 1 attempt(s), at byte 0: " \
           f"HTTPError: HTTP Error 404" in err
    assert "An evaluation reads its split whole: metrics over part of the gallery would " \
           "not be the split's, so none are given" in err
    assert not metrics.exists()  # half a gallery's metrics are not written as the split's


def test_nothing_is_written_through_a_link_in_a_received_run_folder(tiny_quickstart_run,
                                                                     tmp_path, capsys):
    run, _ = tiny_quickstart_run
    train, export = load_tool("train"), load_tool("export")
    config = str(ROOT / "configs" / "quickstart.yaml")
    yours = tmp_path / "yours.txt"
    yours.write_text("yours\n")
    # the run lock of a received run folder, resumed (issue 39, item 5)
    got = tmp_path / "GOTRUN"
    got.mkdir()
    (got / ".mmgoal-run.lock").symlink_to(yours)
    assert train.main([config, "--work-dir", str(got), "--resume"]) == 2
    assert f"error: {got / '.mmgoal-run.lock'} is a symbolic link (to {yours}); mmgoal " \
           f"writes no file through a link it did not make" in capsys.readouterr().err
    # a run file: refused before the run starts, not at its first log line
    (got / ".mmgoal-run.lock").unlink()
    (got / "metrics.jsonl").symlink_to(yours)
    assert train.main([config, "--work-dir", str(got), "--resume"]) == 2
    assert f"error: {got / 'metrics.jsonl'} is a symbolic link" in capsys.readouterr().err
    assert yours.read_text() == "yours\n"
    # an export over a link to an earlier export of yours
    earlier = tmp_path / "earlier.pt"
    assert export.main([str(run), "--out", str(earlier)]) == 0
    before = earlier.read_bytes()
    (tmp_path / "x.pt").symlink_to(earlier)
    assert export.main([str(run), "--best", "--out", str(tmp_path / "x.pt")]) == 2
    assert f"{tmp_path / 'x.pt'} is a symbolic link (to {earlier})" in capsys.readouterr().err
    assert earlier.read_bytes() == before


def test_a_run_folder_that_cannot_be_written_is_a_sentence(tmp_path, capsys):
    train = load_tool("train")
    config = str(ROOT / "configs" / "quickstart.yaml")
    (tmp_path / "run" / ".mmgoal-run.lock").mkdir(parents=True)
    assert train.main([config, "--work-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"error: the run lock {tmp_path / 'run' / '.mmgoal-run.lock'} is a folder; mmgoal " \
           f"writes a file there: move the folder away" in err
    assert train.main([config, "--work-dir", "/proc/x"]) == 2
    err = capsys.readouterr().err
    assert "error: --work-dir /proc/x cannot be created (No such file or directory); give a " \
           "folder you can write, or create it first" in err
    assert "Traceback" not in err


def test_a_huge_config_file_is_refused_unread(tmp_path):
    huge = tmp_path / "huge.yaml"
    with open(huge, "wb") as stream:  # sparse: a GB that takes no disk
        stream.truncate(2**30)
    config = tmp_path / "got.yaml"
    config.write_text("_base_: huge.yaml\n")
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=rf"^config {huge} \(a _base_ of {config}\) is "
                                             rf"larger than 1,048,576 bytes, and a config is a "
                                             rf"few KB: it is not read"):
            load_config(config)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20


def test_the_configs_sample_bound_reaches_the_evaluation(tiny_quickstart_run, tmp_path,
                                                         capsys):
    from mmgoal.data.pipeline import EvalReader

    assert EvalReader.of_split({"shards": "s.tar", "caption_key": "txt"},
                               {"eval_batch_size": 8, "num_workers": 2,
                                "max_sample_bytes": 100}) == EvalReader("s.tar", 8, "txt", 2, 100)
    run, out = tiny_quickstart_run
    evaluate = load_tool("eval")
    # every 32-px sample is over 100 bytes: skipped unread, none left to evaluate
    assert evaluate.main([str(run), "--device", "cpu", "--out", str(tmp_path / "m.json"),
                          "--cfg-options", "data.max_sample_bytes=100"]) == 2
    assert "error: no readable sample in" in capsys.readouterr().err
    assert not (tmp_path / "m.json").exists()


def relabel(path, tensor: str, dtype: str) -> None:
    """Rewrite the safetensors header of ``path`` so that ``tensor`` says ``dtype`` (of the
    same byte width: the file stays valid)."""
    data = bytearray(path.read_bytes())
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    header[tensor]["dtype"] = dtype
    text = json.dumps(header, separators=(",", ":")).encode().ljust(size)
    assert len(text) == size
    data[8:8 + size] = text
    path.write_bytes(bytes(data))


def test_a_tensor_relabelled_in_a_safetensors_header_is_refused(tiny_quickstart_run, tmp_path,
                                                                caplog):
    run, _ = tiny_quickstart_run
    export = received_export(run, tmp_path)
    relabel(export, "image_proj.weight", "I32")  # the same bytes, read as integers
    with pytest.raises(ValueError, match=r"image_proj.weight is int32 where the model holds "
                                         r"float32: its values would not be the weights it "
                                         r"names"):
        mmgoal.load(export, device="cpu")
    # two floating types: converted, and said
    state = load_checkpoint(run / "checkpoints" / "best.pt")
    state["model"]["image_proj.weight"] = state["model"]["image_proj.weight"].double()
    wide = tmp_path / "wide.safetensors"
    save_safetensors({"model": state["model"], "tokenizer": state["tokenizer"],
                      "config": state["config"], "epoch": 0, "exported_from": "x"}, wide)
    with caplog.at_level(logging.WARNING):
        loaded = mmgoal.load(wide, device="cpu")
    assert "1 tensors are of another floating type than the model's (image_proj.weight is " \
           "torch.float64, the model torch.float32); they are converted" in caplog.text
    assert loaded.model.image_proj.weight.dtype == torch.float32
