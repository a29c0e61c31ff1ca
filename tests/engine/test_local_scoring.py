"""Local scoring (docs/distributed.md, "Local scoring"): on 2 and 4 gloo ranks, each rank
streams only its share of the score tiles (its images against every text; the columns'
statistics combined over the ranks), and every objective gives the one-process loss,
statistics and gradients of the global batch, whatever the tiles."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ranks import run_ranks  # tests/ranks.py

from mmgoal.engine.step import TrainingStep
from mmgoal.registry import OBJECTIVES

PER_RANK = 3
DIM = 6
OBJECTIVES_ON_ROWS = [
    {"type": "InfoNCELoss", "temperature": 0.1},
    {"type": "TripletLoss", "margin": 0.2},
    {"type": "TripletLoss", "margin": 0.2, "max_violation": False, "reduction": "mean"},
    {"type": "NTXentHardLoss", "tau": 5.0},
    {"type": "CircleLoss", "reduction": "mean"},
    {"type": "BinomialDevianceLoss"},
    {"type": "SigLIPLoss"},
    {"type": "ObjectiveSum", "terms": [{"type": "InfoNCELoss"}, {"type": "SigLIPLoss"}]},
    {"type": "MultiSimilarityLoss", "eps": 0.5, "reduction": "mean"},
    # GOAL's 15 combinations; eps wide enough that the multi-similarity sets are not empty
    *({"type": "GoalObjective", "triplet": triplet, "pair": pair, "reduction": reduction}
      for triplet in ("con", "nca", "cir")
      for pair, reduction in (("con", "sum"), ("lin", "mean"), ("sig", "sum"),
                              ({"type": "lin_ms", "eps": 0.5}, "sum"),
                              ({"type": "sig_ms", "eps": 0.5}, "mean"))),
]


class Towers(torch.nn.Module):
    """Two linear towers over random inputs, scored by the cosine (tiles are products of
    the embeddings); it records the shapes of every score matrix it computes itself."""

    dot_product_scores = True

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.image = torch.nn.Linear(DIM, DIM, dtype=torch.float64)
        self.text = torch.nn.Linear(DIM, DIM, dtype=torch.float64)
        self.scored: list[tuple[int, int]] = []

    def encode_image(self, batch):
        return F.normalize(self.image(batch["image_inputs"]), dim=-1)

    def encode_text(self, batch):
        return F.normalize(self.text(batch["text_inputs"]), dim=-1)

    def similarity(self, images, texts):
        self.scored.append((len(images), len(texts)))
        return images @ texts.T


def global_batch(world: int) -> dict:
    """``world * PER_RANK`` pairs; images 1 and 2 share an id (two captions of one image)."""
    generator = torch.Generator().manual_seed(world)
    n = world * PER_RANK
    ids = list(range(n))
    ids[2] = ids[1]
    return {"image_inputs": torch.randn(n, DIM, generator=generator, dtype=torch.float64),
            "text_inputs": torch.randn(n, DIM, generator=generator, dtype=torch.float64),
            "image_ids": ids}


def rank_batch(batch: dict, rank: int) -> dict:
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    return {key: value[mine] for key, value in batch.items()}


def with_groups(batch: dict) -> dict:
    from mmgoal.distributed import id_hashes

    return {**batch, "image_groups": id_hashes(batch["image_ids"])}


def losses_and_gradients(step: TrainingStep, batch: dict) -> tuple[dict, dict]:
    outputs = step(with_groups(batch))
    outputs["loss"].backward()
    # every output, the logged statistics too (GOAL's medians and mean triplet weight)
    losses = {k: v.detach().double() for k, v in outputs.items()}
    return losses, {name: p.grad.clone() for name, p in step.named_parameters()
                    if p.grad is not None}


def step_of(config: dict, scoring: str, tile: tuple = (None, None)) -> TrainingStep:
    model = Towers()
    objective = OBJECTIVES.build(config, model=model).double()
    return TrainingStep(model, objective, scoring=scoring, tile_rows=tile[0],
                        tile_cols=tile[1])


# tiles of 1 x 2 on 2 ranks (many tiles a rank, a column's statistics over several), the
# default (one tile) on 4
TILE = {2: (1, 2), 4: (None, None)}


def on_rank(rank, world, config, scoring):
    step = step_of(config, scoring, TILE.get(world, (None, None)))
    losses, gradients = losses_and_gradients(step, rank_batch(global_batch(world), rank))
    for grad in gradients.values():  # what DDP's all-reduce does: the ranks' mean
        dist.all_reduce(grad)
        grad /= world
    return {"losses": losses, "gradients": gradients, "scored": step.model.scored}


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_local_scoring_gives_the_global_loss_and_gradients(tmp_path, world):
    # every objective that works on rows, in one launch of the ranks per world size
    results = run_ranks(on_ranks_all, tmp_path, world=world)
    for index, config in enumerate(OBJECTIVES_ON_ROWS):
        one = step_of(config, "local")  # one process: the whole matrix
        losses, gradients = losses_and_gradients(one, global_batch(world))
        for rank, result in enumerate(results):
            got = result[index]
            assert got["losses"].keys() == losses.keys(), config
            for key, value in losses.items():
                torch.testing.assert_close(got["losses"][key], value, atol=1e-10, rtol=0,
                                           msg=f"{config} {key} rank {rank}")
            assert got["gradients"].keys() == gradients.keys(), config
            for name, value in gradients.items():
                torch.testing.assert_close(got["gradients"][name], value, atol=1e-10, rtol=0,
                                           msg=f"{config} {name} rank {rank}")
            assert got["scored"] == [], config  # the scores were tiles, never a matrix


def on_ranks_all(rank, world):
    return [on_rank(rank, world, config, "local") for config in OBJECTIVES_ON_ROWS]


def on_rank_replicated(rank, world):
    return on_rank(rank, world, {"type": "InfoNCELoss"}, "replicated")


@pytest.mark.multiprocess
def test_replicated_scoring_and_objectives_on_the_whole_matrix_score_it_all(tmp_path):
    replicated = run_ranks(on_rank_replicated, tmp_path, world=2)
    losses, gradients = losses_and_gradients(step_of({"type": "InfoNCELoss"}, "local"),
                                             global_batch(2))
    for result in replicated:
        assert result["scored"] == []  # every rank streamed every tile
        torch.testing.assert_close(result["losses"]["infonce_loss"], losses["infonce_loss"])
        for name, value in gradients.items():
            torch.testing.assert_close(result["gradients"][name], value)


LAM_AUTO = {"type": "GoalObjective", "triplet": "cir",
            "pair": {"type": "sig_ms", "eps": 0.5, "lam": "auto", "lam_momentum": 0.5,
                     "lam_steps": None}}


def two_steps(step: TrainingStep, batch: dict, reduce_gradients) -> dict:
    """Two steps of ``lam: auto`` on one batch: the second uses the lam the first's
    statistics (every rank's, gathered) moved to."""
    first, _ = losses_and_gradients(step, batch)
    step.objective.finish_step(True)
    step.zero_grad()
    second, gradients = losses_and_gradients(step, batch)
    reduce_gradients(gradients)
    return {"first": first, "second": second, "gradients": gradients}


def on_rank_lam_auto(rank, world):
    def ddp_mean(gradients):
        for grad in gradients.values():
            dist.all_reduce(grad)
            grad /= world
    return two_steps(step_of(LAM_AUTO, "local"), rank_batch(global_batch(world), rank),
                     ddp_mean)


@pytest.mark.multiprocess
def test_lam_auto_moves_alike_under_local_scoring(tmp_path):
    results = run_ranks(on_rank_lam_auto, tmp_path, world=2)
    one = two_steps(step_of(LAM_AUTO, "local"), global_batch(2), lambda gradients: None)
    assert one["first"]["lam"] != one["second"]["lam"]  # the step moved it
    for result in results:
        for key in ("first", "second"):
            for name, value in one[key].items():
                torch.testing.assert_close(result[key][name], value, atol=1e-10, rtol=0,
                                           msg=f"{key} {name}")
        for name, value in one["gradients"].items():
            torch.testing.assert_close(result["gradients"][name], value, atol=1e-10, rtol=0)


class CrossTowers(Towers):
    """Region and word features of random lengths, scored by SCAN's stacked cross
    attention; it records the tiles it cross-attends, and how many chosen pairs."""

    dot_product_scores = False
    similarity_uses_tokens = True

    FRAGMENTS = 3

    def _fragments(self, kind, tower, inputs, lengths):
        from mmgoal.sequences import length_mask

        tokens = F.normalize(tower(inputs).reshape(len(inputs), self.FRAGMENTS, -1), dim=-1)
        width = int(lengths.max())
        mask = length_mask(lengths, width)
        tokens = tokens[:, :width]
        return kind(F.normalize(tokens.mean(1), dim=-1), tokens=tokens, mask=mask)

    def encode_image(self, batch):
        from mmgoal.structures import ImageFeatures

        return self._fragments(ImageFeatures, self.image_regions, batch["image_inputs"],
                               torch.full((len(batch["image_inputs"]),), self.FRAGMENTS))

    def encode_text(self, batch):
        from mmgoal.structures import TextFeatures

        return self._fragments(TextFeatures, self.text_words, batch["text_inputs"],
                               batch["lengths"])

    def __init__(self) -> None:
        super().__init__()
        self.image_regions = torch.nn.Linear(DIM, self.FRAGMENTS * 4, dtype=torch.float64)
        self.text_words = torch.nn.Linear(DIM, self.FRAGMENTS * 4, dtype=torch.float64)
        self.pairs = 0

    def similarity(self, images, texts):
        from mmgoal.models.layers.cross_attention import scan_similarity

        self.scored.append((len(images.tokens), len(texts.tokens)))
        return scan_similarity(images.tokens, images.mask, texts.tokens, texts.mask, "t2i",
                               9.0, "avg", 6.0)

    def pair_similarity(self, images, texts):
        from mmgoal.models.layers.cross_attention import scan_pair_similarity

        self.pairs += len(images.tokens)
        return scan_pair_similarity(images.tokens, images.mask, texts.tokens, texts.mask,
                                    "t2i", 9.0, "avg", 6.0)

    def attention(self, images, texts):
        from mmgoal.models.layers.cross_attention import scan_attention

        return scan_attention(images.tokens, images.mask, texts.tokens, texts.mask, "t2i", 9.0)


SCAN_OBJECTIVE = {"type": "GoalObjective", "triplet": "cir", "pair": "sig"}


def scan_step(constraints: bool) -> TrainingStep:
    from mmgoal.registry import CONSTRAINTS

    model = CrossTowers()
    built = [CONSTRAINTS.build({"type": kind, "margin": 0.5, "reduction": reduction}).double()
             for kind, reduction in (("CCRConstraint", "sum"), ("CCSConstraint", "mean"))]
    return TrainingStep(model, OBJECTIVES.build(SCAN_OBJECTIVE).double(),
                        built if constraints else [])


def scan_batch(world: int, constraints: bool) -> dict:
    """The global batch; without the constraints, texts of 1 to 3 words (the longest on
    rank 0 only: the gathered words are padded); with them, texts of one word, so that
    CCR's sampled query word is the only one (and CCS, needing two, contributes 0)."""
    lengths = ([1] * world * PER_RANK if constraints else
               [3] + [1 + i % 2 for i in range(1, world * PER_RANK)])
    return {**global_batch(world), "lengths": torch.tensor(lengths)}


def on_rank_scan(rank, world):
    results = []
    for constraints in (False, True):
        step = scan_step(constraints)
        losses, gradients = losses_and_gradients(
            step, rank_batch(scan_batch(world, constraints), rank))
        for grad in gradients.values():
            dist.all_reduce(grad)
            grad /= world
        results.append({"losses": losses, "gradients": gradients,
                        "scored": step.model.scored, "pairs": step.model.pairs})
    return results


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_cross_attention_scoring_is_divided_over_the_ranks(tmp_path, world):
    """SCAN-style scoring (GOAL on its tiles), with and without CCR and CCS: each rank
    cross-attends its images with every text once without a graph (n^2 / world pairs),
    then only its triplets' O(n) pairs with one, and the step's losses, statistics and
    gradients equal one process's on the global batch."""
    results = run_ranks(on_rank_scan, tmp_path, world=world)
    n = world * PER_RANK
    for index, constraints in enumerate((False, True)):
        one = scan_step(constraints)
        losses, gradients = losses_and_gradients(one, scan_batch(world, constraints))
        assert one.model.scored == [(n, n)]
        if constraints:
            assert losses["ccr_loss"] > 0 and losses["ccr_active"] > 0
        for rank, result in enumerate(result[index] for result in results):
            assert result["scored"] == [(PER_RANK, n)]  # n^2 / world pairs, not n^2
            # again with a graph: the positive pairs of its images and of its texts (at most
            # two each: one image has two captions) and their mined negatives, O(n), no tile
            assert 0 < result["pairs"] <= 8 * PER_RANK, result["pairs"]
            assert result["losses"].keys() == losses.keys()
            for key, value in losses.items():
                torch.testing.assert_close(result["losses"][key], value, atol=1e-10, rtol=0,
                                           msg=f"{key} rank {rank}")
            for name, value in gradients.items():
                torch.testing.assert_close(result["gradients"][name], value, atol=1e-10,
                                           rtol=0, msg=f"{name} rank {rank}")
