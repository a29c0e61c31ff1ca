"""Objectives on features gathered over 2 processes (gloo, CPU) match one process."""


import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ranks import run_ranks  # tests/ranks.py
from torch.utils._python_dispatch import TorchDispatchMode

from mmgoal.distributed import (
    all_objects,
    check_equal_shapes,
    gather,
    gather_each,
    gather_groups,
    gather_rows,
)
from mmgoal.objectives.mining import positives_from_groups
from mmgoal.registry import OBJECTIVES
from mmgoal.structures import ImageFeatures, ObjectiveInputs, TextFeatures

BATCH, DIM = 12, 5
IDS = [0, 1, 1, 2, 3, 4, 4, 5, 6, 7, 8, 8]  # duplicates across the rank split
OBJECTIVES_TRIED = {
    "goal": {"type": "GoalObjective", "triplet": "cir", "pair": "sig_ms"},
    # a parameter used after the gather: its gradient must not be counted twice
    "infonce": {"type": "InfoNCELoss", "temperature": 0.1, "learnable": True},
}
LAM_AUTO = {"type": "GoalObjective", "triplet": "cir",
            "pair": {"type": "sig_ms", "lam": "auto", "lam_momentum": 0.5}}


def make_problem(name):
    torch.manual_seed(0)
    image_encoder = torch.nn.Linear(DIM, 4, dtype=torch.float64)
    text_encoder = torch.nn.Linear(DIM, 4, dtype=torch.float64)
    objective = OBJECTIVES.build(OBJECTIVES_TRIED[name]).double()
    images = torch.randn(BATCH, DIM, dtype=torch.float64)
    texts = torch.randn(BATCH, DIM, dtype=torch.float64)
    return image_encoder, text_encoder, objective, images, texts


def step(image_encoder, text_encoder, objective, images, texts, ids):
    """One SGD step; the loss sees the features of every rank."""
    img = gather(F.normalize(image_encoder(images), dim=-1))
    txt = gather(F.normalize(text_encoder(texts), dim=-1))
    outputs = objective(ObjectiveInputs(img @ txt.T, positives_from_groups(gather_groups(ids))))
    sum(v for k, v in outputs.items() if k.endswith("_loss")).backward()
    params = [*image_encoder.parameters(), *text_encoder.parameters(), *objective.parameters()]
    for p in params:
        if dist.is_initialized():  # what data parallel does: average the ranks' gradients
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        p.data -= 0.1 * p.grad
    return [p.detach().clone() for p in params]


def lam_trajectories(slices):
    """``lam: auto`` after each of 3 steps, scoring the features of ``slices`` of each
    step's batch: gathered over the ranks (one global score matrix), and alone (features
    not gathered: one score matrix per slice, as the micro-batches of one step)."""
    torch.manual_seed(1)
    objectives = {"gathered": OBJECTIVES.build(LAM_AUTO), "alone": OBJECTIVES.build(LAM_AUTO)}
    trajectories = {name: [] for name in objectives}
    for _ in range(3):
        images = F.normalize(torch.randn(BATCH, DIM, dtype=torch.float64), dim=-1)
        texts = F.normalize(torch.randn(BATCH, DIM, dtype=torch.float64), dim=-1)
        gathered = [gather(torch.cat([part[s] for s in slices]))
                    for part in (images, texts)]
        groups = gather_groups([i for s in slices for i in IDS[s]])
        objectives["gathered"](ObjectiveInputs(gathered[0] @ gathered[1].T,
                                               positives_from_groups(groups)))
        for s in slices:
            objectives["alone"](ObjectiveInputs(images[s] @ texts[s].T,
                                                positives_from_groups(torch.tensor(IDS[s]))))
        for name, objective in objectives.items():
            objective.finish_step(True)  # all-gathers the ranks' statistics
            trajectories[name].append(objective.adaptive_lam.value)
    return trajectories


def on_rank(rank, world):
    local = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    results = {}
    for name in OBJECTIVES_TRIED:
        image_encoder, text_encoder, objective, images, texts = make_problem(name)
        results[name] = step(image_encoder, text_encoder, objective, images[local],
                             texts[local], IDS[local])
    # word tokens of different lengths on the two ranks: padded to the longest
    width = 3 + 2 * rank
    tokens = torch.full((2, width, 4), float(rank + 1), requires_grad=True)
    mask = torch.ones(2, width, dtype=torch.bool)
    gathered = gather(TextFeatures(tokens[:, 0], tokens=tokens, mask=mask))
    (gathered.tokens * torch.arange(4.0)[:, None, None]).sum().backward()
    results["tokens"] = [gathered.tokens.detach(), gathered.mask, tokens.grad]
    results["lam"] = lam_trajectories([local])
    results["rows"] = rows_of_other_ranks(rank)
    results["collectives"] = collectives_of_a_gather(rank)
    results["uneven"] = uneven_parts(rank)
    # shapes that differ across ranks: a message, not an aborted process group
    try:
        check_equal_shapes(torch.zeros(3 + rank, 4), torch.zeros(2, 4))
    except RuntimeError as error:
        results["unequal"] = str(error)
    return results


def rank_features(rank):
    """Rank r's 3 + r rows (values 10 r + row), tokens 2 + r wide, the last column masked."""
    rows = 3 + rank
    values = 10.0 * rank + torch.arange(float(rows))
    tokens = values[:, None, None].expand(rows, 2 + rank, 2).clone()
    mask = torch.ones(rows, 2 + rank, dtype=torch.bool)
    mask[:, -1] = False
    return ImageFeatures(values[:, None].clone(), tokens=tokens, mask=mask)


def rows_of_other_ranks(rank):
    """Each rank wants other rows (rank 0: rank 1's first row then its own last; rank 1:
    rows of both, out of order, one twice)."""
    wanted = [(1, 0), (0, 2)] if rank == 0 else [(0, 1), (1, 3), (0, 1), (1, 1)]
    got = gather_rows(rank_features(rank), wanted)
    return wanted, [got.embedding, got.tokens, got.mask]  # tensors: what ranks.py sends


class Collectives(TorchDispatchMode):
    """Records torch's functional collectives by name (the gathers and their backward)
    and the object exchanges (``dist.all_gather_object``) made inside it."""

    def __enter__(self):
        self.calls, self.original = [], dist.all_gather_object

        def exchange(*args, **kwargs):
            self.calls.append("shape exchange")
            return self.original(*args, **kwargs)
        dist.all_gather_object = exchange
        return super().__enter__()

    def __exit__(self, *exc):
        dist.all_gather_object = self.original
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional" and func.__name__ != "wait_tensor.default":
            self.calls.append(func.__name__.removesuffix(".default"))
        return func(*args, **(kwargs or {}))


def collectives_of_a_gather(rank):
    """The collectives that gathering features with tokens costs: one shape exchange for
    them all, one gather of each field; the backward of a (4, 8) gather is a
    reduce-scatter of the global gradient (not an all-reduce)."""
    with Collectives() as forward:
        features = TextFeatures(torch.randn(2, 4), tokens=torch.randn(2, 3 + rank, 4),
                                mask=torch.ones(2, 3 + rank, dtype=torch.bool))
        gather(features)
    with Collectives() as backward:
        local = torch.randn(4, 8, requires_grad=True)
        gather(local).sum().backward()
    return {"forward": [call for call in forward.calls if call != "_wrap_tensor_autograd"],
            "gather_and_backward": [call for call in backward.calls
                                    if call != "_wrap_tensor_autograd"]}


def uneven_parts(rank):
    """Rows of different counts (1-D statistics, with gradient) and a rank without a
    value (an empty evaluation share)."""
    values = torch.arange(3.0 + rank, requires_grad=True)
    joined = gather(values * (rank + 1), uneven=True)
    (joined * torch.arange(len(joined))).sum().backward()
    each = gather_each(None if rank == 0 else rank_features(rank))
    try:  # tokens of unequal batches: a message, not rows out of place
        gather(rank_features(rank))
    except RuntimeError as error:
        refused = str(error)
    return {"joined": joined.detach(), "grad": values.grad, "each": each[1].tokens,
            "none": each[0] is None, "objects": all_objects({"rank": rank}),
            "refused": refused}


@pytest.mark.multiprocess
def test_two_process_gathered_update_matches_one_process(tmp_path):
    ranks = run_ranks(on_rank, tmp_path)
    for name in OBJECTIVES_TRIED:
        single = step(*make_problem(name), IDS)
        for gathered in ranks:
            for a, b in zip(single, gathered[name]):
                torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    for rank, result in enumerate(ranks):
        tokens, mask, grad = result["tokens"]
        assert tokens.shape == (4, 5, 4)  # 2 + 2 rows, 5 = the longer rank's width
        assert mask.tolist() == [[True] * 3 + [False] * 2] * 2 + [[True] * 5] * 2
        assert tokens[:2, :3].eq(1).all() and tokens[:2, 3:].eq(0).all()
        assert tokens[2:].eq(2).all()
        # every rank's loss weighs its rows 0..3: the summed gradient of a slice is 2x
        expected = 2 * torch.arange(4.0)[2 * rank:2 * rank + 2, None, None].expand_as(grad)
        assert torch.equal(grad, expected)
    sources = [rank_features(rank) for rank in range(2)]
    for wanted, (embedding, tokens, mask) in (result["rows"] for result in ranks):
        assert embedding[:, 0].tolist() == [10.0 * r + row for r, row in wanted]
        assert tokens.shape == (len(wanted), 3, 2)  # the widest of the ranks used: 3
        for k, (r, row) in enumerate(wanted):
            width = 2 + r
            assert torch.equal(tokens[k, :width], sources[r].tokens[row])
            assert tokens[k, width:].eq(0).all()
            assert mask[k].tolist() == sources[r].mask[row].tolist() + [False] * (3 - width)
    # lam: auto is the same on every rank and equal to one process's: over the gathered
    # global batch, and over the ranks' own batches as the micro-batches of one step
    single = lam_trajectories([slice(0, BATCH // 2), slice(BATCH // 2, BATCH)])
    assert single["gathered"] != single["alone"]  # hardest negatives of 12 vs of 6
    for rank, result in enumerate(ranks):
        assert result["lam"] == single
        # no shape exchange for the pooled embedding, one for the tokens and the mask
        assert result["collectives"] == {
            "forward": ["shape exchange"] + ["all_gather_into_tensor"] * 3,
            "gather_and_backward": ["all_gather_into_tensor", "reduce_scatter_tensor"]}
        uneven = result["uneven"]
        # rank 0's 3 values then rank 1's 4 doubled; each rank's gradient is the sum over
        # the ranks' losses of its values' weights (positions), times its factor
        assert uneven["joined"].tolist() == [0, 1, 2, 0, 2, 4, 6]
        assert uneven["grad"].tolist() == ([0.0, 2.0, 4.0] if rank == 0 else
                                           [12.0, 16.0, 20.0, 24.0])
        assert uneven["none"] and torch.equal(uneven["each"], rank_features(1).tokens)
        assert uneven["objects"] == [{"rank": 0}, {"rank": 1}]
        assert uneven["refused"] == ("gather needs the same number of rows on every rank, "
                                     "got [3, 4] (embedding); drop partial batches")
        assert result["unequal"] == (
            "every rank must gather tensors of the same shapes, got [[(3, 4), (2, 4)], "
            "[(4, 4), (2, 4)]] (rank by rank); drop partial batches")


def test_gather_is_the_identity_in_one_process():
    x = torch.randn(3, 2, requires_grad=True)
    assert gather(x) is x and gather(x, uneven=True) is x and gather_each(x) == [x]
    # gather_rows picks a process's own rows, repeats and order kept
    features = rank_features(0)
    picked = gather_rows(features, [(0, 2), (0, 0), (0, 2)])
    assert picked.embedding[:, 0].tolist() == [2.0, 0.0, 2.0]
    assert torch.equal(picked.mask, features.mask[[2, 0, 2]])
    assert torch.equal(gather_rows(x, []), x[:0])
    assert torch.equal(gather_groups(["a", "b", "a"])[[0, 2]].diff(), torch.zeros(1).long())
