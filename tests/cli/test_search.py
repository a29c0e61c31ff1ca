"""tools/search.py prints what ``Retriever.search`` finds and draws it; bad input ends in
``error:`` and exit code 2."""

import copy

import pytest
import webdataset as wds
from PIL import Image
from script_modules import load_tool

import mmgoal
from mmgoal.data.pipeline import decode_sample, expand_shards, read_captions
from mmgoal.data.shards import ShardWriter
from mmgoal.registry import MODELS, TOKENIZERS
from mmgoal.runs.checkpoint import load_checkpoint, save_checkpoint

search_tool = load_tool("search")
QUERIES = ["a large red circle left of a small blue square", "a green triangle"]


def printed_rankings(stdout: str) -> dict[str, list[tuple[str, float]]]:
    """``{"query: ..." or "image: ...": [(name, score), ...]}`` of the tool's output."""
    rankings: dict[str, list] = {}
    for line in stdout.splitlines():
        if line.startswith(("query: ", "image: ")):
            title = line
            rankings[title] = []
        elif line.startswith(" "):
            rank, score, name = line.split(maxsplit=2)
            assert int(rank) == len(rankings[title]) + 1
            rankings[title].append((name, float(score)))
    return rankings


def assert_same_ranking(printed, hits, names):
    assert [name for name, _ in printed] == [str(names[i]) for i, _ in hits]
    assert [score for _, score in printed] == pytest.approx([s for _, s in hits], abs=1e-5)


def recording(monkeypatch, name: str) -> list:
    """Keep the figures the tool's ``name`` function draws."""
    figures, draw = [], getattr(search_tool, name)
    monkeypatch.setattr(search_tool, name,
                        lambda *args, **kwargs: figures.append(draw(*args, **kwargs))
                        or figures[-1])
    return figures


@pytest.fixture(scope="module")
def test_split(tiny_quickstart_run):
    """(run, shard pattern, the decoded samples, the trained model)."""
    run, out = tiny_quickstart_run
    shards = str(out / "test-{000000..000001}.tar")
    samples = list(wds.DataPipeline(wds.SimpleShardList(expand_shards(shards)),
                                    wds.tarfile_to_samples(), wds.map(decode_sample)))
    return run, shards, samples, mmgoal.load(run, device="cpu")


def test_text_queries_rank_the_shard_images_as_search_does(test_split, tmp_path, capsys,
                                                            monkeypatch):
    run, shards, samples, model = test_split
    figures = recording(monkeypatch, "draw_image_hits")
    out = tmp_path / "hits.png"
    assert search_tool.main([str(run), "--images", shards, "--query", *QUERIES[:1], "--query",
                             QUERIES[1], "--top-k", "5", "--device", "cpu",
                             "--out", str(out)]) == 0
    printed = printed_rankings(capsys.readouterr().out)
    hits = model.search(QUERIES, model.index([s["image"] for s in samples]), top_k=5)
    image_ids = [s["image_id"] for s in samples]
    assert list(printed) == [f"query: {q}" for q in QUERIES]
    for query, row in zip(QUERIES, hits):
        assert_same_ranking(printed[f"query: {query}"], row, image_ids)
    # one row of 5 panels per query, titled with the query; each panel its hit's image
    fig = figures[0]
    assert [sub.get_suptitle() for sub in fig.subfigs] == QUERIES
    drawn = [ax for ax in fig.axes if ax.images]
    assert len(drawn) == 10
    assert [ax.get_title().split("\n")[0] for ax in drawn[:5]] == \
        [f"{rank}. {score:.3f}" for rank, (_, score) in enumerate(hits[0], start=1)]
    best = samples[hits[1][0][0]]["image"]
    assert drawn[5].images[0].get_array().shape == (best.height, best.width, 3)
    with Image.open(out) as picture:
        rows, columns = search_tool.grid_shape(5)
        assert picture.size == (round(max(columns, 3) * search_tool.PANEL_INCHES * search_tool.DPI),
                                round(2 * (rows * search_tool.PANEL_INCHES
                                           + search_tool.QUERY_TITLE_INCHES) * search_tool.DPI))


def test_an_image_query_ranks_captions_as_search_does(test_split, tmp_path, capsys, monkeypatch):
    run, shards, samples, model = test_split
    figures = recording(monkeypatch, "draw_caption_hits")
    query = tmp_path / "scene.png"
    samples[3]["image"].save(query)
    assert search_tool.main([str(run), "--images", shards, "--image", str(query), "--top-k",
                             "4", "--device", "cpu", "--out", str(tmp_path / "c.png")]) == 0
    captions = list(dict.fromkeys(read_captions(shards)))
    hits = model.search([str(query)], model.index(captions, kind="texts"), top_k=4)[0]
    printed = printed_rankings(capsys.readouterr().out)
    assert_same_ranking(printed[f"image: {query}"], hits, captions)
    texts = [t.get_text() for t in figures[0].axes[1].texts]
    assert len(texts) == 4 and texts[0].startswith(f"1. {hits[0][1]:.3f}  ")
    assert (tmp_path / "c.png").stat().st_size > 0
    # captions from a file: fewer than --top-k, all ranked
    (tmp_path / "captions.txt").write_text(f"{captions[0]}\n\na blue star\n{captions[40]}\n")
    own = [captions[0], "a blue star", captions[40]]
    assert search_tool.main([str(run), "--texts", str(tmp_path / "captions.txt"), "--image",
                             str(query), "--device", "cpu"]) == 0
    hits = model.search([str(query)], model.index(own, kind="texts"), top_k=3)[0]
    assert_same_ranking(printed_rankings(capsys.readouterr().out)[f"image: {query}"], hits, own)


def test_a_folder_of_images_is_a_gallery(test_split, tmp_path, capsys):
    run, _, samples, model = test_split
    paths = []
    for index, sample in enumerate(samples[:6]):
        paths.append(str(tmp_path / f"scene{index}.png"))
        sample["image"].save(paths[-1])
    (tmp_path / "notes.txt").write_text("not an image")  # a folder's other files are left out
    assert search_tool.main([str(run), "--images", str(tmp_path), "--query", QUERIES[0],
                             "--top-k", "3", "--device", "cpu", "--batch-size", "4"]) == 0
    hits = model.search(QUERIES[:1], model.index(paths), top_k=3)[0]
    assert_same_ranking(printed_rankings(capsys.readouterr().out)[f"query: {QUERIES[0]}"],
                        hits, paths)


def test_an_image_id_written_twice_is_one_hit(test_split, tmp_path, capsys, monkeypatch):
    run, shards, samples, model = test_split
    figures = recording(monkeypatch, "draw_image_hits")
    raw = list(wds.DataPipeline(wds.SimpleShardList(expand_shards(shards)),
                                wds.tarfile_to_samples()))[:5]
    with ShardWriter(tmp_path, "copies", max_count=4) as writer:
        for sample in raw + raw[1:3]:  # two images again, under other keys
            writer.write({"__key__": f"{sample['__key__']}x", "png": sample["png"],
                          "json": sample["json"]})
    assert search_tool.main([str(run), "--images", str(tmp_path / "copies-*.tar"), "--query",
                             QUERIES[0], "--top-k", "10", "--device", "cpu",
                             "--out", str(tmp_path / "hits.png")]) == 0
    hits = model.search(QUERIES[:1], model.index([s["image"] for s in samples[:5]]),
                        top_k=10)[0]
    assert_same_ranking(printed_rankings(capsys.readouterr().out)[f"query: {QUERIES[0]}"],
                        hits, [s["image_id"] for s in samples[:5]])
    assert len([ax for ax in figures[0].axes if ax.images]) == 5


def precomputed_features_checkpoint(run, path):
    """The run's model with an image encoder that reads region features from shards."""
    state = load_checkpoint(run / "checkpoints" / "best.pt")
    cfg = copy.deepcopy(state["config"])
    cfg["model"]["image_encoder"] = {"type": "PrecomputedRegionEncoder", "feature_dim": 8}
    cfg["model"]["image_pooler"] = {"type": "GPO"}
    tokenizer = TOKENIZERS.build(cfg["data"]["tokenizer"])
    tokenizer.load_state_dict(state["tokenizer"])
    model = MODELS.build(cfg["model"], tokenizer=tokenizer)
    save_checkpoint({"model": model.state_dict(), "tokenizer": state["tokenizer"],
                     "config": cfg}, path)
    return path


def test_bad_input_is_explained(test_split, tmp_path, capsys):
    run, shards, samples, _ = test_split
    samples[0]["image"].save(tmp_path / "scene.png")
    (tmp_path / "photos").mkdir()
    (tmp_path / "empty").mkdir()
    samples[1]["image"].save(tmp_path / "photos" / "a.png")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "b.png").write_bytes(b"not a png at all")
    with ShardWriter(tmp_path, "nocaptions", max_count=10) as writer:  # images, no caption
        writer.write({"__key__": "0", "png": (tmp_path / "scene.png").read_bytes(),
                      "json": b'{"image_id": 0, "captions": []}'})
    query = ["--query", "a red circle", "--device", "cpu"]
    for args, message in [
        (["--images", str(tmp_path / "none-*.tar"), *query],
         f"error: --images: shard pattern '{tmp_path}/none-*.tar' matches no file"),
        (["--images", str(tmp_path / "empty"), *query],
         f"error: --images {tmp_path / 'empty'}: the folder holds no image"),
        (["--images", shards, "--image", str(tmp_path / "nowhere.png")],
         f"error: --image {tmp_path / 'nowhere.png'} does not exist"),
        (query, "error: give the gallery: --images shards or image files\n"),
        (["--images", str(tmp_path / "photos"), "--image", str(tmp_path / "scene.png")],
         "error: --image ranks captions, and image files have none"),
        (["--images", shards, "--texts", str(tmp_path / "scene.png"), *query],
         "error: --texts holds the captions --image ranks"),
        (["--texts", str(tmp_path / "nowhere.txt"), "--image", str(tmp_path / "scene.png")],
         f"error: --texts {tmp_path / 'nowhere.txt'} does not exist"),
        (["--images", str(tmp_path / "broken"), *query],
         f"error: image {tmp_path / 'broken' / 'b.png'}: unreadable image (not an image "
         f"format PIL knows)"),
        (["--images", shards, "--image", str(tmp_path / "broken" / "b.png"), "--device", "cpu"],
         f"error: image {tmp_path / 'broken' / 'b.png'}: unreadable image (not an image "
         f"format PIL knows)"),
        (["--images", str(tmp_path / "nocaptions-000000.tar"), "--image",
          str(tmp_path / "scene.png"), "--device", "cpu"],
         "error: the shards hold no captions for --image to rank"),
    ]:
        assert search_tool.main([str(run), *args]) == 2, args
        assert message in capsys.readouterr().err, args
    for args, message in [
        (["--images", shards, *query, "--top-k", "0"],
         "argument --top-k: must be at least 1, got 0"),
        (["--images", shards], "one of the arguments --query --image is required"),
        (["--images", shards, *query, "--image", str(tmp_path / "scene.png")],
         "argument --image: not allowed with argument --query"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            search_tool.main([str(run), *args])
        assert exit_.value.code == 2 and message in capsys.readouterr().err, args
    # a model that reads precomputed region features cannot encode these images
    checkpoint = str(precomputed_features_checkpoint(run, tmp_path / "regions.pt"))
    assert search_tool.main([checkpoint, "--images", shards, *query]) == 2
    assert "error: DualEncoder does not encode these images: it reads " in \
        capsys.readouterr().err
    assert search_tool.main([checkpoint, "--images", shards, "--image",
                             str(tmp_path / "scene.png"), "--device", "cpu"]) == 2
    assert "error: DualEncoder does not encode images here" in capsys.readouterr().err
