import math

import pytest
import torch
import torch.nn.functional as F

from mmgoal.data.tokenizers import WordTokenizer
from mmgoal.models.layers.cross_attention import scan_attention, scan_similarity
from mmgoal.registry import MODELS
from mmgoal.structures import ObjectiveInputs


def direct_pair_score(queries, keys, lambda_softmax, pooling, lambda_lse):
    """The SCAN formulas for one pair, real fragments only, written out step by step."""
    relevances = []
    raw = torch.stack([torch.stack([F.cosine_similarity(q, k, dim=0) for k in keys])
                       for q in queries])  # (Q, K)
    scores = F.leaky_relu(raw, 0.1)
    scores = scores / (scores.pow(2).sum(0, keepdim=True).sqrt() + 1e-8)
    for q, row in zip(queries, scores):
        weights = torch.softmax(lambda_softmax * row, dim=0)
        attended = (weights[:, None] * keys).sum(0)
        relevances.append(F.cosine_similarity(q, attended, dim=0))
    relevances = torch.stack(relevances)
    if pooling == "avg":
        return relevances.mean()
    return torch.log(torch.exp(lambda_lse * relevances).sum()) / lambda_lse


def random_items(n, max_len, dim, generator):
    lengths = torch.randint(1, max_len + 1, (n,), generator=generator)
    lengths[0] = max_len
    feats = F.normalize(torch.randn(n, max_len, dim, generator=generator, dtype=torch.float64),
                        dim=-1)
    mask = torch.arange(max_len)[None] < lengths[:, None]
    # Padding holds garbage: it must not matter.
    feats = torch.where(mask[..., None], feats, torch.full_like(feats, 3.0))
    return feats, mask


@pytest.mark.parametrize("direction,pooling,lambda_softmax,lambda_lse", [
    ("t2i", "avg", 9.0, 6.0), ("t2i", "lse", 9.0, 6.0),
    ("i2t", "avg", 4.0, 5.0), ("i2t", "lse", 4.0, 20.0),
])
def test_scan_similarity_equals_the_per_pair_formulas(direction, pooling, lambda_softmax,
                                                      lambda_lse):
    generator = torch.Generator().manual_seed(0)
    regions, region_mask = random_items(4, 7, 16, generator)
    words, word_mask = random_items(5, 6, 16, generator)
    sims = scan_similarity(regions, region_mask, words, word_mask, direction, lambda_softmax,
                           pooling, lambda_lse)
    assert sims.shape == (4, 5)
    expected = torch.zeros(4, 5, dtype=torch.float64)
    for i in range(4):
        for t in range(5):
            v, e = regions[i][region_mask[i]], words[t][word_mask[t]]
            queries, keys = (e, v) if direction == "t2i" else (v, e)
            expected[i, t] = direct_pair_score(queries, keys, lambda_softmax, pooling, lambda_lse)
    torch.testing.assert_close(sims, expected, atol=1e-5, rtol=0)


def test_scan_similarity_float32_and_gradients_match_the_direct_formulas():
    generator = torch.Generator().manual_seed(1)
    regions, region_mask = random_items(3, 5, 8, generator)
    words, word_mask = random_items(3, 4, 8, generator)
    regions32 = regions.float().requires_grad_()
    sims = scan_similarity(regions32, region_mask, words.float(), word_mask)
    sims.sum().backward()
    regions64 = regions.clone().requires_grad_()
    total = sum(direct_pair_score(words[t][word_mask[t]], regions64[i][region_mask[i]],
                                  9.0, "avg", 6.0)
                for i in range(3) for t in range(3))
    total.backward()
    torch.testing.assert_close(regions32.grad.double() * region_mask[..., None],
                               regions64.grad * region_mask[..., None], atol=1e-5, rtol=1e-4)
    assert (regions32.grad[~region_mask] == 0).all()


def test_zero_padding_gives_finite_gradients():
    # Encoders pad with zeros: a padded key's scores are all zero, where sqrt has no gradient.
    generator = torch.Generator().manual_seed(3)
    regions, region_mask = random_items(3, 5, 8, generator)
    words, word_mask = random_items(4, 6, 8, generator)
    regions = (regions * region_mask[..., None]).float().requires_grad_()
    words = (words * word_mask[..., None]).float().requires_grad_()
    for direction in ("t2i", "i2t"):
        for pooling in ("avg", "lse"):
            scan_similarity(regions, region_mask, words, word_mask, direction,
                            pooling=pooling).sum().backward()
    scan_attention(regions, region_mask, words[:3], word_mask[:3]).weights.sum().backward()
    assert torch.isfinite(regions.grad).all() and torch.isfinite(words.grad).all()


def test_scan_attention_of_matched_pairs_is_the_diagonal_of_the_all_pairs_attention():
    generator = torch.Generator().manual_seed(2)
    regions, region_mask = random_items(3, 5, 8, generator)
    words, word_mask = random_items(3, 4, 8, generator)
    attention = scan_attention(regions, region_mask, words, word_mask, "t2i", 9.0)
    assert attention.weights.shape == (3, 4, 5)
    for b in range(3):
        v, e = regions[b][region_mask[b]], words[b][word_mask[b]]
        scores = F.leaky_relu(e @ v.T, 0.1)
        scores = scores / (scores.pow(2).sum(0, keepdim=True).sqrt() + 1e-8)
        expected = torch.softmax(9.0 * scores, dim=1)
        got = attention.weights[b][word_mask[b]][:, region_mask[b]]
        torch.testing.assert_close(got, expected)
        assert (attention.weights[b][:, ~region_mask[b]] == 0).all()


def test_scan_rejects_unknown_direction_and_pooling():
    x, m = torch.randn(2, 3, 4), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="direction must be t2i or i2t, got 'both'"):
        scan_similarity(x, m, x, m, direction="both")
    with pytest.raises(ValueError, match="pooling must be avg or lse, got 'max'"):
        scan_similarity(x, m, x, m, pooling="max")


@pytest.fixture
def tokenizer():
    return WordTokenizer().fit(["a red circle", "a blue square to the left of a star"])


def scan_model(tokenizer, **kwargs):
    return MODELS.build({
        "type": "SCAN", "embed_dim": 16,
        "image_encoder": {"type": "PrecomputedRegionEncoder", "feature_dim": 10},
        "text_encoder": {"type": "GRUTextEncoder", "word_dim": 8, "hidden_size": 16,
                         "bidirectional": True},
        **kwargs,
    }, tokenizer=tokenizer)


TINY_BERT = {"type": "HFTextEncoder", "config": {
    "model_type": "bert", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
    "intermediate_size": 32, "max_position_embeddings": 32}}


@pytest.mark.parametrize("words", ["gru", "bert"])
def test_scan_model_scores_its_fragments_with_scan_similarity(tokenizer, words):
    torch.manual_seed(0)
    text = {"text_encoder": TINY_BERT, "text_projection": "linear"} if words == "bert" else {}
    model = scan_model(tokenizer, direction="i2t", lambda_softmax=4.0, pooling="lse",
                       lambda_lse=5.0, **text).eval()
    batch = {"regions": torch.randn(2, 5, 10), "region_lengths": torch.tensor([5, 3]),
             **tokenizer(["a red circle", "a blue square to the left of a star", "a star"])}
    images, texts = model.encode_image(batch), model.encode_text(batch)
    assert images.tokens.shape == (2, 5, 16) and texts.tokens.shape == (3, 9, 16)
    torch.testing.assert_close(images.tokens[images.mask].norm(dim=-1), torch.ones(8))
    sims = model.similarity(images, texts)
    for i in range(2):
        for t in range(3):
            v, e = images.tokens[i][images.mask[i]], texts.tokens[t][texts.mask[t]]
            expected = direct_pair_score(v.double(), e.double(), 4.0, "lse", 5.0)
            assert math.isclose(sims[i, t].item(), expected.item(), abs_tol=1e-5)


def test_scan_refuses_an_image_encoder_without_regions(tokenizer):
    with pytest.raises(ValueError, match="SCAN needs image regions"):
        scan_model(tokenizer, image_encoder={"type": "TimmImageEncoder",
                                             "model_name": "mmgoal_small_cnn"})


def test_goal_objectives_train_scan_through_its_cross_attention(tokenizer):
    """GOAL's con x con on SCAN's score matrix gives the triplet loss's parameter gradients,
    and cir x sig_ms (the combination no paper tried on SCAN) reaches every parameter."""
    from mmgoal.registry import OBJECTIVES

    torch.manual_seed(0)
    model = scan_model(tokenizer)
    batch = {"regions": torch.randn(4, 5, 10), "region_lengths": torch.tensor([5, 3, 4, 2]),
             **tokenizer(["a red circle", "a blue square", "a star to the left", "a red star"])}

    def grads(objective, key):
        model.zero_grad()
        sims = model.similarity(model.encode_image(batch), model.encode_text(batch))
        objective(ObjectiveInputs(sims))[key].backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    triplet = grads(OBJECTIVES.build({"type": "TripletLoss", "margin": 0.2}), "triplet_loss")
    goal = grads(OBJECTIVES.build({"type": "GoalObjective", "pair": "con",
                                   "triplet": {"type": "con", "margin": 0.2}}), "goal_loss")
    assert triplet.keys() == goal.keys() and len(goal) == len(list(model.parameters()))
    for name in goal:
        torch.testing.assert_close(goal[name], triplet[name], msg=name)
    cir = grads(OBJECTIVES.build({"type": "GoalObjective", "triplet": "cir", "pair": "sig_ms"}),
                "goal_loss")
    assert all(g.abs().sum() > 0 for g in cir.values())


@pytest.mark.parametrize("direction,pooling,lambda_softmax", [
    ("t2i", "avg", 9.0), ("i2t", "lse", 4.0), ("t2i", "lse", 30.0)])
def test_evaluation_path_equals_the_autograd_path(direction, pooling, lambda_softmax):
    """Without autograd the scores are computed in place: the same numbers."""
    generator = torch.Generator().manual_seed(4)
    regions, region_mask = random_items(5, 7, 16, generator)
    words, word_mask = random_items(6, 5, 16, generator)
    regions, words = regions.float(), words.float()
    with_grad = scan_similarity(regions.clone().requires_grad_(), region_mask, words,
                                word_mask, direction, lambda_softmax, pooling, 10.0)
    with torch.no_grad():
        in_place = scan_similarity(regions, region_mask, words, word_mask, direction,
                                   lambda_softmax, pooling, 10.0)
    torch.testing.assert_close(in_place, with_grad.detach(), atol=1e-6, rtol=1e-6)


def test_reused_buffers_give_the_same_scores_across_block_shapes():
    from mmgoal.devices import reuse_buffers

    generator = torch.Generator().manual_seed(5)
    regions, region_mask = random_items(6, 7, 16, generator)
    words, word_mask = random_items(9, 5, 16, generator)
    regions, words = regions.float(), words.float()
    with torch.no_grad():
        fresh = [scan_similarity(regions[a:b], region_mask[a:b], words, word_mask)
                 for a, b in ((0, 6), (0, 2), (2, 6))]
        with reuse_buffers():  # a large block first, then smaller ones in the same arrays
            reused = [scan_similarity(regions[a:b], region_mask[a:b], words, word_mask)
                      for a, b in ((0, 6), (0, 2), (2, 6))]
    for a, b in zip(fresh, reused):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    # Autograd never uses the shared arrays.
    with reuse_buffers():
        graded = scan_similarity(regions.clone().requires_grad_(), region_mask, words, word_mask)
    graded.sum().backward()
    torch.testing.assert_close(graded.detach(), fresh[0], atol=1e-6, rtol=1e-6)
