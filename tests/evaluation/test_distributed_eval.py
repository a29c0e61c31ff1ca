"""Evaluation spread over 2 processes (gloo, CPU) gives one process's gallery, score
matrices and metrics: a dual encoder, SCAN, and the tiny X-VLM with ITM re-ranking."""

from pathlib import Path

import pytest
import torch
from ranks import run_ranks  # tests/ranks.py

ROOT = Path(__file__).resolve().parents[2]
MODELS = {  # the config, and what shrinks it to the tiny benchmark's 32-pixel images
    "dual": ("configs/quickstart.yaml", {"embed_dim": 16,
                                         "image_encoder": {"model_kwargs": {"widths": [8, 16]}},
                                         "text_encoder": {"word_dim": 8, "hidden_size": 16}}),
    "scan": ("configs/scan/scan_synthetic.yaml", {}),
    "xvlm": ("configs/xvlm/xvlm_tiny_synthetic.yaml",
             {"vision": {"model_kwargs": {"img_size": 32}}}),
}
SCORING = {"dual": {}, "scan": {"block_images": 4, "max_block_mb": 0.05},
           "xvlm": {"rerank_k": 5, "rerank_batch_size": 16}}


def build(name, shards):
    from mmgoal.config import merge_configs
    from mmgoal.data.pipeline import read_captions
    from mmgoal.data.tokenizers import WordTokenizer
    from mmgoal.runs.loading import build_from_config
    from mmgoal.runs.schema import load_model_config

    path, shrink = MODELS[name]
    cfg = load_model_config(ROOT / path)
    cfg["model"] = merge_configs(cfg["model"], shrink)
    cfg["data"]["image_size"] = 32
    vocab = WordTokenizer().fit(read_captions(shards)).words[2:]
    cfg["data"]["tokenizer"] = {"type": "WordTokenizer", "vocab": vocab, "max_length": 40}
    torch.manual_seed(0)  # the same weights in every process
    return build_from_config(cfg, device="cpu")


def evaluate(name, shards, across_ranks):
    from mmgoal.data.pipeline import EvalReader
    from mmgoal.evaluation.gallery import evaluate_retrieval, gallery_similarity
    from mmgoal.evaluation.rerank import itm_rerank
    from mmgoal.runs.schema import ScoringConfig
    from mmgoal.structures import Member

    loaded = build(name, shards)
    members = [Member(loaded.model, loaded.transform, loaded.tokenizer)]
    encoded = {"images": 0, "texts": 0}  # the rows this process encodes, for the first gallery

    def counting(kind, encode):
        def call(batch):
            features = encode(batch)
            encoded[kind] += len(features.embedding)
            return features
        return call

    for kind, method in (("images", "encode_image"), ("texts", "encode_text")):
        setattr(loaded.model, method, counting(kind, getattr(loaded.model, method)))
    scoring = ScoringConfig.of(SCORING[name])
    # batches of 6: 7 of them over the 40 images (3 shards of up to 16), odd on purpose
    reader = EvalReader(shards, 6)
    sims, gallery = gallery_similarity(members, reader, {**SCORING[name], "rerank_k": 0},
                                       progress=False, across_ranks=across_ranks)
    result = {"sims": sims, "text_to_image": gallery.text_to_image,
              "image_ids": gallery.image_ids, "captions": gallery.captions,
              "embeddings": gallery.images.embedding, "image_rows": gallery.image_rows,
              "encoded": dict(encoded)}
    if scoring.rerank_k:
        sims, gallery = gallery_similarity(members, reader, SCORING[name], progress=False,
                                           across_ranks=across_ranks)
        result["reranked"] = itm_rerank(loaded.model, gallery.images, gallery.texts, sims,
                                        scoring.rerank_k, 16, progress=False,
                                        across_ranks=across_ranks)
    result["metrics"] = evaluate_retrieval(members, reader, progress=False,
                                           scoring=SCORING[name], across_ranks=across_ranks)
    return result


def on_rank(rank, world, shards):
    return {name: evaluate(name, shards, across_ranks=True) for name in MODELS}


@pytest.fixture(scope="module")
def gallery_shards(tiny_benchmark, tmp_path_factory):
    """The tiny test split rewritten in shards of 16 with a repeated image and a corrupt
    sample, so that the ranks' shares hold both."""
    import tarfile

    from mmgoal.data.shards import ShardWriter

    out, summary = tiny_benchmark
    folder = tmp_path_factory.mktemp("gallery")
    samples = []
    for path in sorted(out.glob("test-*.tar")):
        with tarfile.open(path) as archive:
            members = {}
            for member in archive.getmembers():
                key, _, suffix = member.name.partition(".")
                members.setdefault(key, {"__key__": key})[suffix] = \
                    archive.extractfile(member).read()
            samples += list(members.values())
    samples.insert(9, {**samples[3], "__key__": "copy3"})        # a repeated image
    samples.insert(20, {**samples[5], "__key__": "broken", "png": b"not a png"})
    with ShardWriter(folder, "test", max_count=16) as writer:
        for sample in samples:
            writer.write(sample)
    return str(folder / "test-*.tar"), len(samples)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_ranks_evaluate_as_one_process(gallery_shards, tmp_path):
    shards, _ = gallery_shards
    ranks = run_ranks(on_rank, tmp_path, shards)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: the same reductions, so ties break alike
    try:
        singles = {name: evaluate(name, shards, across_ranks=False) for name in MODELS}
    finally:
        torch.set_num_threads(threads)
    for name, single in singles.items():
        assert single["metrics"]["skipped"] == 1 and len(single["image_ids"]) == 40
        # each rank encodes its share: 4 and 3 of the 7 image batches (read before the
        # repeated image is dropped), half of the captions
        assert [r[name]["encoded"]["images"] for r in ranks] == [24, 17], name
        texts = single["encoded"]["texts"]
        assert sum(r[name]["encoded"]["texts"] for r in ranks) == texts, name
        assert all(abs(r[name]["encoded"]["texts"] - texts / 2) <= 6 for r in ranks), name
        # SCAN's region features stay spread: each rank holds the images it scores,
        # whole blocks of 4 (20 and 20 of the 40), and none of the other rank's
        rows = [r[name]["image_rows"] for r in ranks]
        assert rows == ([(0, 20), (20, 40)] if name == "scan" else [None, None]), name
        assert single["image_rows"] is None
        for result in (r[name] for r in ranks):
            assert result["image_ids"] == single["image_ids"], name
            assert result["captions"] == single["captions"], name
            assert torch.equal(result["text_to_image"], single["text_to_image"]), name
            held = slice(*(result["image_rows"] or (0, 40)))
            torch.testing.assert_close(result["embeddings"], single["embeddings"][held],
                                       atol=1e-6, rtol=0)
            torch.testing.assert_close(result["sims"], single["sims"], atol=1e-6, rtol=0)
            for mine, theirs in zip(result.get("reranked", ()), single.get("reranked", ())):
                torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=0)
            assert result["metrics"] == single["metrics"], name
    assert len(single["reranked"]) == 2  # the X-VLM was re-ranked
