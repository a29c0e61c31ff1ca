"""Zero-shot classification: equal to CLIP_benchmark's on the same exported model and set;
both layouts; the metrics against a hand-computed case; bad input."""

import json
import os

import pytest
import torch
from clip_runs import OPEN_CLIP, tiny_run
from script_modules import load_tool

import mmgoal
from mmgoal.data.classification import read_classification_set, write_synthetic_classification
from mmgoal.data.pipeline import IncompleteSplitError
from mmgoal.evaluation.zeroshot import classification_metrics, evaluate_zeroshot

open_clip = pytest.importorskip("open_clip")


@pytest.fixture(scope="module")
def exported_clip(tiny_benchmark, tmp_path_factory):
    """A tiny CLIP run trained one epoch, and its open_clip export."""
    out, _ = tiny_benchmark
    work = tmp_path_factory.mktemp("zeroshot")
    run = tiny_run(out, OPEN_CLIP, {"tokenizer": None}, work / "run")
    assert load_tool("export").main([str(run), "--format", "open_clip",
                                     "--out", str(work / "export")]) == 0
    return run, work / "export"


def test_classification_metrics_against_a_hand_computed_case():
    logits = torch.tensor([[0.9, 0.1, 0.0, 0.0, 0.0, 0.0],   # label 0: top-1
                           [0.1, 0.2, 0.9, 0.0, 0.0, 0.0],   # label 1: 2nd
                           [-.1, 0.0, 0.1, 0.2, 0.3, 0.9],   # label 0: 6th (not top-5)
                           [0.0, 0.0, 0.0, 0.0, 0.0, 0.9]])  # label 5: top-1
    labels = torch.tensor([0, 1, 0, 5])
    metrics = classification_metrics(logits, labels, 6)
    assert metrics["zeroshot_top1"] == pytest.approx(50.0)
    assert metrics["zeroshot_top5"] == pytest.approx(75.0)
    # recalls of the classes with images: 0 -> 1/2, 1 -> 0, 5 -> 1
    assert metrics["zeroshot_mean_per_class_recall"] == pytest.approx(100 * 1.5 / 3)
    # under 5 classes there is no top-5
    assert "zeroshot_top5" not in classification_metrics(logits[:, :4], labels % 4, 4)


def numpy2_accuracy(output, target, topk=(1,)):
    """clip_benchmark 1.6.2's ``accuracy``, whose ``float()`` of a one-element array numpy
    2.4 refuses, with ``.item()``: the same count."""
    pred = output.topk(max(topk), 1, True, True)[1].t()
    correct = pred.eq(target.view(1, -1).expand_as(pred))
    return [correct[:k].reshape(-1).float().sum().item() / len(target) for k in topk]


def test_zero_shot_top1_equals_clip_benchmarks_on_the_export(exported_clip, tmp_path,
                                                             monkeypatch):
    """`mmgoal eval EXPORT --zeroshot SET` against clip_benchmark's own evaluation of the
    same export loaded by open_clip, on the set read by clip_benchmark's own reader (its
    class embeddings, logits and per-class recall; top-k counted as it counts them)."""
    zeroshot = pytest.importorskip("clip_benchmark.metrics.zeroshot_classification")
    from clip_benchmark.datasets.builder import build_wds_dataset

    monkeypatch.setattr(zeroshot, "accuracy", numpy2_accuracy)
    _, export = exported_clip
    cset = write_synthetic_classification(tmp_path / "shapes", "shape", count=48,
                                          image_size=32, shard_size=20)
    assert len(cset.shards) == 3 and cset.classnames[0] == "circle"
    out = tmp_path / "zs.json"
    assert load_tool("eval").main([str(export), "--zeroshot", str(tmp_path / "shapes"),
                                       "--no-retrieval", "--out", str(out)]) == 0
    ours = json.loads(out.read_text())["metrics"]

    model, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{export}")
    model.eval()
    dataset = build_wds_dataset("wds/shapes", transform=preprocess, split="test",
                                data_dir=str(tmp_path / "shapes"))
    loader = torch.utils.data.DataLoader(dataset.batched(16), batch_size=None)
    loader.dataset.classes = dataset.classes
    theirs = zeroshot.evaluate(model, loader, open_clip.get_tokenizer(f"local-dir:{export}"),
                               dataset.classes, dataset.templates, "cpu", amp=False)
    assert ours["zeroshot_images"] == 48 and ours["zeroshot_skipped"] == 0
    assert ours["zeroshot_top1"] == pytest.approx(100 * theirs["acc1"], abs=1e-9)
    assert ours["zeroshot_top5"] == pytest.approx(100 * theirs["acc5"], abs=1e-9)
    assert ours["zeroshot_mean_per_class_recall"] == pytest.approx(
        100 * theirs["mean_per_class_recall"], abs=1e-9)
    assert 0 < ours["zeroshot_top5"] < 100  # a number that could be wrong either way


def test_an_image_folder_gives_the_webdataset_sets_metrics_and_skips_a_bad_image(
        exported_clip, tmp_path):
    run, _ = exported_clip
    loaded = mmgoal.load(run, device="cpu")
    kwargs = {"task": "colour", "count": 40, "image_size": 32}
    wds_set = write_synthetic_classification(tmp_path / "wds", **kwargs)
    folder_set = write_synthetic_classification(tmp_path / "folder", layout="folder", **kwargs)
    assert folder_set.classnames == wds_set.classnames and len(folder_set.files) == 40
    a = evaluate_zeroshot(loaded, wds_set, batch_size=7, progress=False)
    b = evaluate_zeroshot(loaded, folder_set, batch_size=40, progress=False)
    assert a == pytest.approx(b, abs=1e-9)
    bad = folder_set.files[0][0]
    bad.write_bytes(b"not a png")
    os.mkfifo(bad.with_name("fifo.png"))  # never opened: it would wait for a writer for ever
    c = evaluate_zeroshot(loaded, read_classification_set(tmp_path / "folder"), progress=False)
    assert c["zeroshot_images"] == 39 and c["zeroshot_skipped"] == 2
    # decoded in 2 DataLoader workers, as the gallery's images: the same numbers and skips
    d = evaluate_zeroshot(loaded, read_classification_set(tmp_path / "folder"), batch_size=6,
                          progress=False, num_workers=2)
    assert d == pytest.approx(c, abs=1e-9)
    with open(wds_set.shards[0], "r+b") as shard:  # a shard cut short: the set is not whole
        shard.truncate(os.path.getsize(wds_set.shards[0]) // 2)
    with pytest.raises(IncompleteSplitError):
        evaluate_zeroshot(loaded, wds_set, batch_size=7, progress=False, num_workers=2)


def test_bad_classification_sets_say_what_to_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such folder"):
        read_classification_set(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="neither a WebDataset classification set"):
        read_classification_set(tmp_path / "empty")
    write_synthetic_classification(tmp_path / "s", count=4, image_size=16)
    with pytest.raises(FileNotFoundError, match=r"set .*s has no split 'tset'; its splits: "
                                                r"test$"):
        read_classification_set(tmp_path / "s", "tset")
    (tmp_path / "s" / "zeroshot_classification_templates.txt").write_text("a photo\n")
    with pytest.raises(ValueError, match=r"every prompt must hold the class name as \{c\}"):
        read_classification_set(tmp_path / "s")
    for name in ("zeroshot_classification_templates.txt", "classnames.txt"):
        with open(tmp_path / "s" / name, "r+b") as file:  # 3 GB, sparse: refused unread
            file.truncate(3_000_000_000)
        with pytest.raises(ValueError, match=rf"list file {tmp_path / 's' / name} holds "
                                             rf"3,000,000,000 bytes, more than the 16,777,216 "
                                             rf"mmgoal reads for a list file"):
            read_classification_set(tmp_path / "s")
        (tmp_path / "s" / name).write_text("a {c}\n" if "templates" in name else "a\nb\n")
    count = tmp_path / "s" / "test" / "nshards.txt"
    for text in ("1000000000000", "two", "0"):  # never a list of 10^12 names
        count.write_text(text)
        with pytest.raises(ValueError, match=r"must hold the number of the split's shards "
                                             r"\(0.tar \.\.\. <n-1>.tar, 1 .tar files there\)"):
            read_classification_set(tmp_path / "s")
    (tmp_path / "s" / "test" / "0.tar").rename(tmp_path / "s" / "test" / "7.tar")
    count.write_text("1")
    with pytest.raises(FileNotFoundError, match="lacks 0.tar"):
        read_classification_set(tmp_path / "s")
    with pytest.raises(SystemExit):  # --no-retrieval alone leaves nothing to evaluate
        load_tool("eval").main(["x.pt", "--no-retrieval"])


def test_every_validation_logs_the_zero_shot_accuracy_beside_rsum(tiny_benchmark, tmp_path):
    out, _ = tiny_benchmark
    cset = write_synthetic_classification(tmp_path / "colours", "colour", count=16,
                                          image_size=32)
    run = tiny_run(out, OPEN_CLIP, {"tokenizer": None}, tmp_path / "run",
                   evaluation={"zeroshot": {"root": str(tmp_path / "colours")}})
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in records if r["type"] == "val"]
    assert len(val) == 1 and "rsum" in val[0]
    expected = evaluate_zeroshot(mmgoal.load(run, device="cpu"), cset, progress=False)
    assert val[0]["zeroshot_top1"] == pytest.approx(expected["zeroshot_top1"], abs=1e-9)
    assert val[0]["zeroshot_images"] == 16
    with pytest.raises(ValueError, match=r"evaluation.zeroshot must be \{root: DIR"):
        tiny_run(out, OPEN_CLIP, {"tokenizer": None}, tmp_path / "bad",
                 evaluation={"zeroshot": {"folder": "x"}})


def test_an_image_folders_progress_bar_has_its_images_for_total(tmp_path, monkeypatch):
    """An image folder lists its images: their number is the bar's total (shards' is not
    known unread: a count of images)."""
    from tqdm import tqdm

    import mmgoal.console as console
    from mmgoal.evaluation.zeroshot import zero_shot_logits
    from mmgoal.structures import ImageFeatures, TextFeatures

    bars = []

    class RecordedBar(tqdm):
        def __init__(self, *args, **kwargs):  # drawn, though no terminal is there
            super().__init__(*args, **{**kwargs, "disable": False})
            bars.append(self)

    class MeanColour(torch.nn.Module):
        def encode_image(self, batch):
            return ImageFeatures(batch["images"].mean((2, 3)))

        def encode_text(self, tokens):
            return TextFeatures(torch.ones(len(tokens["prompts"]), 3))

    monkeypatch.setattr(console, "tqdm", RecordedBar)
    folder = write_synthetic_classification(tmp_path / "shapes", count=18, image_size=16,
                                            layout="folder")
    zero_shot_logits(MeanColour(), lambda image: torch.zeros(3, 2, 2),
                     lambda prompts: {"prompts": prompts}, folder, batch_size=4)
    assert [(bar.unit, bar.total, bar.n) for bar in bars] == [("class", 6, 6), ("image", 18, 18)]
