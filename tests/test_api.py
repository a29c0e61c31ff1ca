"""The Python API: a trained model used from Python gives what tools/evaluate.py gives."""


from pathlib import Path

import pytest
import torch
import webdataset as wds

import mmgoal
from mmgoal.data.pipeline import decode_sample, expand_shards
from mmgoal.engine.schema import load_run_config
from mmgoal.engine.trainer import Trainer
from mmgoal.evaluation.gallery import evaluate_retrieval
from mmgoal.evaluation.loading import load_for_evaluation
from mmgoal.evaluation.retrieval import retrieval_metrics

ROOT = Path(__file__).resolve().parents[1]


def test_score_over_the_test_split_gives_the_evaluation_recalls(tiny_benchmark, tmp_path):
    out, _ = tiny_benchmark
    cfg = load_run_config(ROOT / "configs" / "quickstart.yaml", [
        "model.embed_dim=16", "model.image_encoder.model_kwargs.widths=[8, 16]",
        "model.text_encoder.word_dim=8", "model.text_encoder.hidden_size=16",
        "data.image_size=32", "data.num_workers=0", "train.epochs=1", "train.progress=False",
        "hooks=[]", f"data.train.shards={out}/train-{{000000..000002}}.tar",
        "data.train.batch_size=16", f"data.val.shards={out}/val-000000.tar",
        f"data.test.shards={out}/test-{{000000..000001}}.tar"])
    Trainer(cfg, tmp_path / "run").fit()
    model = mmgoal.load(tmp_path / "run", device="cpu")
    # the test split as a user has it: PIL images and their captions
    samples = list(wds.DataPipeline(wds.SimpleShardList(expand_shards(
        str(out / "test-{000000..000001}.tar"))), wds.tarfile_to_samples(),
        wds.map(decode_sample)))
    images = [s["image"] for s in samples]
    captions = [c for s in samples for c in s["captions"]]
    text_to_image = torch.tensor([i for i, s in enumerate(samples) for _ in s["captions"]])
    sims = model.score(images, captions)
    assert sims.shape == (40, len(captions))
    loaded = load_for_evaluation(tmp_path / "run" / "checkpoints" / "best.pt", device="cpu")
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
    with pytest.raises(FileNotFoundError, match="has no checkpoints/best.pt"):
        mmgoal.load(tmp_path)
