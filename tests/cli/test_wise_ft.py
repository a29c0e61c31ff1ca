"""WiSE-FT: the weights between a fine-tuned CLIP and its pretrained start, exported and
evaluated at each alpha; a run without a start is refused."""

import copy
import json

import pytest
import torch
from clip_runs import MODEL_KWARGS, OPEN_CLIP, tiny_run
from script_modules import load_tool

import mmgoal
from mmgoal.data.classification import read_classification_set, write_synthetic_classification
from mmgoal.evaluation.wise_ft import WiseFT, interpolate_weights
from mmgoal.evaluation.zeroshot import evaluate_zeroshot
from mmgoal.runs.loading import load_for_evaluation

open_clip = pytest.importorskip("open_clip")
safetensors_torch = pytest.importorskip("safetensors.torch")


@pytest.fixture(scope="module")
def finetuned_from_a_start(tiny_benchmark, tmp_path_factory):
    """A tiny CLIP's "pretrained" weights in a file, and a run fine-tuned from them."""
    out, _ = tiny_benchmark
    work = tmp_path_factory.mktemp("wise_ft")
    torch.manual_seed(7)
    start = open_clip.create_model("ViT-B-32", **copy.deepcopy(MODEL_KWARGS)).state_dict()
    safetensors_torch.save_file({k: v.contiguous() for k, v in start.items()},
                                str(work / "start.safetensors"))
    model = {**OPEN_CLIP, "pretrained": str(work / "start.safetensors")}
    run = tiny_run(out, model, {"tokenizer": None}, work / "run")
    return run, start, out


def test_the_weights_run_from_the_start_to_the_fine_tune(finetuned_from_a_start):
    run, start, _ = finetuned_from_a_start
    loaded = load_for_evaluation(run, device="cpu")
    mix = WiseFT(loaded)
    tuned = loaded.model.state_dict()
    name = next(k for k, v in tuned.items() if v.is_floating_point() and v.dim() == 2)
    ours = {k[len("model."):]: v for k, v in mix.weights(0.0).items()}
    assert all(torch.equal(ours[k], v) for k, v in start.items())  # 0: the start itself
    assert all(torch.equal(v, tuned[k]) for k, v in mix.weights(1.0).items())
    assert not torch.equal(tuned[name], mix.weights(0.0)[name])  # the run trained it
    torch.testing.assert_close(mix.weights(0.25)[name],
                               0.75 * mix.weights(0.0)[name] + 0.25 * tuned[name])
    with pytest.raises(ValueError, match=r"lies in \[0, 1\], got 1.5"):
        interpolate_weights(mix.start, mix.finetuned, 1.5)


def test_an_export_at_an_alpha_embeds_as_the_mixed_model(finetuned_from_a_start, tmp_path):
    run, _, out = finetuned_from_a_start
    folder = tmp_path / "wise"
    assert load_tool("export").main([str(run), "--wise-ft", "0.5", "--format", "open_clip",
                                     "--out", str(folder)]) == 0
    theirs, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{folder}")
    theirs.eval()
    mixed = WiseFT(load_for_evaluation(run, device="cpu")).at(0.5)
    captions = ["a red circle", "two blue squares"]
    tokens = open_clip.get_tokenizer(f"local-dir:{folder}")(captions)
    with torch.no_grad():
        expected = theirs.encode_text(tokens, normalize=True)
        got = mixed.model.encode_text({"tokens": tokens}).embedding
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    # the plain file holds the same weights, and says its alpha
    assert load_tool("export").main([str(run), "--wise-ft", "0.5", "--out",
                                     str(tmp_path / "wise.pt")]) == 0
    back = mmgoal.load(tmp_path / "wise.pt", device="cpu")
    torch.testing.assert_close(back.encode_texts(captions), expected, atol=1e-5, rtol=0)


def test_wise_ft_tabulates_and_plots_each_alpha(finetuned_from_a_start, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run, _, out = finetuned_from_a_start
    write_synthetic_classification(tmp_path / "shapes", "shape", count=24, image_size=32)
    assert load_tool("wise-ft").main([
        str(run), "--alphas", "0", "0.5", "1", "--zeroshot", str(tmp_path / "shapes"),
        "--shards", str(out / "test-{000000..000001}.tar"), "--out", str(tmp_path / "w"),
        "--device", "cpu"]) == 0
    rows = json.loads((tmp_path / "w" / "wise_ft.json").read_text())["rows"]
    assert [row["alpha"] for row in rows] == [0.0, 0.5, 1.0]
    # alpha 1 is the fine-tune as mmgoal eval sees it
    tuned = mmgoal.load(run, device="cpu")
    alone = evaluate_zeroshot(tuned, read_classification_set(tmp_path / "shapes"),
                              progress=False)
    assert rows[2]["zeroshot_top1"] == pytest.approx(alone["zeroshot_top1"], abs=1e-9)
    assert load_tool("eval").main([str(run), "--shards", str(out / "test-{000000..000001}.tar"),
                                   "--out", str(tmp_path / "e.json")]) == 0
    evaluated = json.loads((tmp_path / "e.json").read_text())["metrics"]
    assert rows[2]["rsum"] == pytest.approx(evaluated["rsum"], abs=1e-9)
    assert rows[0]["rsum"] != rows[2]["rsum"]  # the start is another model
    table = (tmp_path / "w" / "wise_ft.md").read_text()
    assert table.startswith("| alpha | rsum |") and table.count("\n") == 5
    assert (tmp_path / "w" / "wise_ft.png").read_bytes()[:4] == b"\x89PNG"


def test_a_run_without_a_pretrained_start_is_refused(tiny_benchmark, tmp_path, capsys):
    out, _ = tiny_benchmark
    run = tiny_run(out, OPEN_CLIP, {"tokenizer": None}, tmp_path / "run")
    write_synthetic_classification(tmp_path / "s", count=4, image_size=32)
    assert load_tool("wise-ft").main([str(run), "--no-retrieval", "--zeroshot",
                                      str(tmp_path / "s")]) == 2
    assert "no pretrained start to interpolate with" in capsys.readouterr().err
    assert load_tool("export").main([str(run), "--wise-ft", "0.5", "--out",
                                     str(tmp_path / "x.pt")]) == 2
    assert "no pretrained start" in capsys.readouterr().err
    assert not (tmp_path / "x.pt").exists()
