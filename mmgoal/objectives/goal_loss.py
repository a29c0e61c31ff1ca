"""``GoalLoss``: GOAL as a plain ``torch.nn.Module`` for a training loop of your own
(open_clip's script, a Hugging Face ``Trainer.compute_loss``): ``GoalObjective``'s ``G``
on ``S = image_embeds @ text_embeds.T``, not re-derived. docs/reference/objectives.md
("GOAL over embeddings") is its contract; docs/objectives.md ("GOAL in your own training
loop") shows it in use.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from mmgoal.config import check_value
from mmgoal.distributed import (
    check_equal_shapes,
    gather,
    global_losses,
    id_hashes,
    world_info,
)
from mmgoal.objectives.goal import GoalObjective
from mmgoal.objectives.hard_negative import Reduction
from mmgoal.objectives.mining import diagonal_positives, positives_from_groups
from mmgoal.scoring import DotScorer, MatrixScorer, ScoreTiles, check_tile
from mmgoal.structures import ObjectiveInputs

# How far a row's norm may be from 1 and still count as L2-normalised: bf16 embeddings
# normalised in float32 and cast are within about 2e-3.
NORM_TOLERANCE = 1e-2
WHAT_IT_TAKES = ("GoalLoss takes image_embeds and text_embeds ((N, D) each, L2-normalised, row "
                 "i of each is pair i) or scores=(N, N)")
SKIP_CHECK = ("GoalLoss(check_values=False) leaves this check out, where a loop must not wait "
              "for the GPU (the loss is then NaN)")


def _check_embeddings(image_embeds: Any, text_embeds: Any, check_values: bool) -> None:
    """Two (N, D) tensors of one dtype and device; with ``check_values``, finite rows that
    are L2-normalised."""
    for name, embeds in (("image_embeds", image_embeds), ("text_embeds", text_embeds)):
        if not isinstance(embeds, torch.Tensor):
            raise TypeError(f"{name} must be a tensor (N, D), got {type(embeds).__name__}")
        if embeds.dim() != 2 or not len(embeds):
            raise ValueError(f"{name} must be (N, D) with N >= 1, got shape "
                             f"{tuple(embeds.shape)}")
    if image_embeds.shape[0] != text_embeds.shape[0]:
        raise ValueError(f"image_embeds has {image_embeds.shape[0]} rows and text_embeds "
                         f"{text_embeds.shape[0]}; row i of each is pair i, so they must match. "
                         f"With several captions per image, repeat the image's row once per "
                         f"caption and pass image_ids")
    if image_embeds.shape[1] != text_embeds.shape[1]:
        raise ValueError(f"image_embeds are {image_embeds.shape[1]}-dimensional and text_embeds "
                         f"{text_embeds.shape[1]}-dimensional; they are scored by a dot product, "
                         f"so they must match (project both into one space)")
    if image_embeds.dtype != text_embeds.dtype or image_embeds.device != text_embeds.device:
        raise ValueError(f"image_embeds are {image_embeds.dtype} on {image_embeds.device}, "
                         f"text_embeds {text_embeds.dtype} on {text_embeds.device}; cast or "
                         f"move one to match the other")
    if not check_values:
        return
    for name, embeds in (("image_embeds", image_embeds), ("text_embeds", text_embeds)):
        norms = embeds.detach().float().norm(dim=-1)
        # one reduction, so one wait for the GPU: a row holding NaN or inf has a norm that is
        # not within the tolerance of 1 either (NaN compares false)
        if bool(((norms - 1).abs() <= NORM_TOLERANCE).all()):
            continue
        bad_rows = (~torch.isfinite(embeds).all(dim=-1)).nonzero().flatten().tolist()
        if bad_rows:
            raise ValueError(f"{name} holds NaN or inf in {len(bad_rows)} of its {len(embeds)} "
                             f"rows (row {bad_rows[0]} first), which would make the loss NaN: "
                             f"the model's outputs are not finite; check the model and its "
                             f"loss scale (learning rate, fp16 overflow), or skip the batch. "
                             f"{SKIP_CHECK}")
        # GOAL's weights (margins, lam) are set for cosine scores in [-1, 1]
        raise ValueError(f"{name} must be L2-normalised (GOAL's weights are set for cosine "
                         f"scores); its row norms lie in [{norms.min():.4g}, "
                         f"{norms.max():.4g}]: pass F.normalize({name}, dim=-1), or "
                         f"scores= of your own")


def _check_scores(scores: Any, check_values: bool) -> None:
    """An (N, N) tensor; with ``check_values``, finite."""
    if not isinstance(scores, torch.Tensor):
        raise TypeError(f"scores must be a tensor (N, N), got {type(scores).__name__}")
    if scores.dim() != 2 or scores.shape[0] != scores.shape[1] or not len(scores):
        raise ValueError(f"scores must be square, (N, N) with N >= 1: image i and text j scored, "
                         f"image i and text i a pair (others with image_ids); got shape "
                         f"{tuple(scores.shape)}")
    if check_values and not bool(torch.isfinite(scores).all()):
        bad = int((~torch.isfinite(scores)).sum())
        raise ValueError(f"scores hold NaN or inf in {bad} of their {scores.numel()} entries, "
                         f"which would make the loss NaN: check the model that scored them and "
                         f"its loss scale, or skip the batch. {SKIP_CHECK}")


def _id_kind(image_id: Any) -> str | None:
    """``an integer`` (Python or numpy, not a bool), ``a string``, or None: not an id."""
    if isinstance(image_id, str):
        return "a string"
    if isinstance(image_id, numbers.Integral) and not isinstance(image_id, bool):
        return "an integer"
    return None


def _check_id_list(image_ids: list) -> None:
    """A list of image ids is all integers or all strings: ids are compared by their text
    (:func:`mmgoal.distributed.id_hashes`), so 1, '1', 1.0 and True would be one image,
    and two Nones would be positives of each other."""
    first = _id_kind(image_ids[0]) if image_ids else None
    for index, image_id in enumerate(image_ids):
        kind = _id_kind(image_id)
        if kind is None or kind != first:
            what = (f"{image_id!r} ({type(image_id).__name__}), which is no image id" if
                    kind is None else f"{image_id!r}, {kind}, while image_ids[0] is "
                                      f"{image_ids[0]!r}, {first}")
            raise ValueError(f"image_ids[{index}] is {what}; a list of image ids must be all "
                             f"integers or all strings (not None, bool or float, and not both "
                             f"kinds: 1 and '1' would name one image): give every pair the id "
                             f"of its image, or pass a 1-D integer tensor")


def _ids_tensor(image_ids: torch.Tensor | Sequence, n_pairs: int,
                device: torch.device) -> torch.Tensor:
    """(N,) int64 on ``device``: an integer tensor as it is, any other ids as their hashes."""
    if isinstance(image_ids, torch.Tensor):
        if image_ids.dim() != 1 or image_ids.is_floating_point() or image_ids.is_complex():
            raise ValueError(f"image_ids must be a 1-D integer tensor or a list of ids, got a "
                             f"{image_ids.dtype} tensor of shape {tuple(image_ids.shape)}")
        ids = image_ids.to(device=device, dtype=torch.long)
    elif hasattr(image_ids, "__len__") and not isinstance(image_ids, (str, bytes)):
        image_ids = list(image_ids)
        _check_id_list(image_ids)
        ids = id_hashes(image_ids, device)
    else:
        raise ValueError(f"image_ids must be a 1-D integer tensor or a list of ids (ints, "
                         f"strings), got {type(image_ids).__name__}")
    if len(ids) != n_pairs:
        raise ValueError(f"image_ids has {len(ids)} ids for {n_pairs} pairs; give one id per "
                         f"pair (row i of the embeddings)")
    return ids


class GoalLoss(nn.Module):
    """GOAL over a batch of paired embeddings (or a score matrix), for any training loop:
    its gradient with respect to ``S`` is ``GoalObjective``'s ``G``, its value the weighted
    violation, for logging (docs/objectives.md, "GOAL in your own training loop").

    Args:
        triplet, pair, reduction: as ``GoalObjective``'s.
        gather: mine the hardest negatives in the global batch of all ranks (each passes as
            many pairs); the loss is the global one.
        step_each_call: with ``lam: auto``, every training-mode call is one optimisation
            step; ``False``: call :meth:`step` after each optimizer step instead.
        tile_rows, tile_cols: the score tiles' shape (``None``: :mod:`mmgoal.scoring`'s).
        check_values: refuse non-finite or unnormalised embeddings and non-finite scores
            (one reduction each that a GPU waits for); shapes, dtypes and ids always.

    Attributes:
        objective: the ``GoalObjective`` (its ``lam: auto`` state in this ``state_dict``).
        last_stats: the last call's outputs but ``goal_loss``, as floats (``{}`` before).
    """

    def __init__(self, triplet: str | Mapping[str, Any] = "con",
                 pair: str | Mapping[str, Any] = "con", reduction: Reduction = "sum", *,
                 gather: bool = False, step_each_call: bool = True,
                 check_values: bool = True, tile_rows: int | None = None,
                 tile_cols: int | None = None) -> None:
        super().__init__()
        check_value("reduction", reduction, Reduction)  # no registry checks a loop's own
        self.objective = GoalObjective(triplet, pair, reduction)
        self.tile_rows = None if tile_rows is None else check_tile(tile_rows, "tile_rows")
        self.tile_cols = None if tile_cols is None else check_tile(tile_cols, "tile_cols")
        self.gather = gather
        self.step_each_call = step_each_call
        self.check_values = check_values
        self._stats: dict[str, torch.Tensor] = {}

    def extra_repr(self) -> str:
        return (f"gather={self.gather}, step_each_call={self.step_each_call}, "
                f"check_values={self.check_values}")

    @property
    def last_stats(self) -> dict[str, float]:
        # kept as tensors and converted here, so a loop that never reads them never syncs
        return {key: float(value) for key, value in self._stats.items()}

    def forward(self, image_embeds: torch.Tensor | None = None,
                text_embeds: torch.Tensor | None = None, *,
                scores: torch.Tensor | None = None,
                image_ids: torch.Tensor | Sequence | None = None) -> torch.Tensor:
        """The GOAL loss of one batch: a scalar whose gradient with respect to the scores is ``G``.

        Args:
            image_embeds, text_embeds: (N, D) L2-normalised; row ``i`` of each is pair ``i``.
            scores: (N, N) a ready score matrix instead of the embeddings; not with ``gather``.
            image_ids: (N,) integer tensor or list of ids (all integers or all strings),
                equal ids positives of each other (``None``: pair ``i`` only); with
                ``gather``, dataset ids, not positions.
        """
        if scores is not None:
            if image_embeds is not None or text_embeds is not None:
                raise ValueError(f"{WHAT_IT_TAKES}, not both: scores are computed from the "
                                 f"embeddings")
            if self.gather:
                raise ValueError("GoalLoss(gather=True) gathers the embeddings of every rank "
                                 "and scores them; with scores= given there is nothing it can "
                                 "gather: pass the embeddings, or gather them yourself "
                                 "(mmgoal.distributed.gather) and build "
                                 "GoalLoss(gather=False)")
            _check_scores(scores, self.check_values)
        else:
            if image_embeds is None or text_embeds is None:
                given = ("neither" if image_embeds is None and text_embeds is None else
                         "only image_embeds" if text_embeds is None else "only text_embeds")
                raise ValueError(f"{WHAT_IT_TAKES}; got {given}")
            _check_embeddings(image_embeds, text_embeds, self.check_values)
        n_pairs = len(scores if scores is not None else image_embeds)
        device = (scores if scores is not None else image_embeds).device
        ids = None if image_ids is None else _ids_tensor(image_ids, n_pairs, device)
        rank, world = world_info()
        sharded = scores is None and self.gather and world > 1
        if scores is not None:  # the matrix given: its tiles are slices of it
            positives = (positives_from_groups(ids) if ids is not None
                         else diagonal_positives(scores))
            tiles = ScoreTiles(MatrixScorer(scores), n_pairs, n_pairs, positives=positives,
                               tile_rows=self.tile_rows, tile_cols=self.tile_cols)
        else:  # never the matrix: this rank's rows of the global batch, in tiles
            own = None
            if sharded:
                check_equal_shapes(image_embeds, text_embeds)
                image_embeds, text_embeds = (gather(image_embeds),
                                             gather(text_embeds))
                ids = None if ids is None else gather(ids)
                own = slice(rank * n_pairs, (rank + 1) * n_pairs)
            count = len(image_embeds)
            groups = ids if ids is not None else torch.arange(count, device=device)
            tiles = ScoreTiles(DotScorer(image_embeds, text_embeds), count, count, groups,
                               rows=own, own_texts=own, tile_rows=self.tile_rows,
                               tile_cols=self.tile_cols)
        outputs = self.objective(ObjectiveInputs(None, tiles=tiles))
        if sharded:  # this rank's part, made the global loss (mmgoal.distributed)
            outputs = global_losses(outputs, world)
        loss = outputs.pop("goal_loss")
        self._stats = {key: value.detach() for key, value in outputs.items()}
        if self.step_each_call and self.training and self.objective.adaptive_lam is not None:
            # G is already computed with this step's lam, so ending the step here is the
            # same as ending it after the optimizer step
            self.step(applied=bool(torch.isfinite(loss)))
        return loss

    def step(self, applied: bool = True) -> None:
        """End an optimisation step (``lam: auto`` takes the statistics of its calls when
        ``applied``). Call it after each optimizer step with ``step_each_call=False``, on
        every rank; a no-op for a fixed ``lam`` or after a call that ended its own step."""
        self.objective.finish_step(applied)
