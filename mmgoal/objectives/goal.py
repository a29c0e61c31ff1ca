"""GOAL: objectives defined by their gradient (Xuan & Chen, WACV 2023).

``GoalObjective`` trains with ``G = dl/dS`` of any triplet weight x pair weight
(docs/reference/goal.md), including combinations no loss integrates to; ``G`` lives on the
O(n) positives and mined negatives, which are scored again to carry it (the paper's eq.
2-4). Unlike the authors' code it honours the incoming gradient, handles several positives
per row, and has no Python loop over the batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from mmgoal.config import close_match_hints
from mmgoal.objectives.adaptive_lam import AdaptiveLam
from mmgoal.objectives.hard_negative import Reduction
from mmgoal.objectives.mining import check_positives, mine_triplets, score_tiles
from mmgoal.objectives.weights import (
    NegativeSums,
    RelativeScores,
    negative_set_statistics,
    negative_sums,
)
from mmgoal.registry import OBJECTIVES, PAIR_WEIGHTS, TRIPLET_WEIGHTS
from mmgoal.scoring import HardestNegative, MatrixScorer, ScoreTiles
from mmgoal.structures import ObjectiveInputs

WEIGHT_REGISTRIES = {"triplet": TRIPLET_WEIGHTS, "pair": PAIR_WEIGHTS}
# lam: auto, mmgoal's adaptive lambda (mmgoal/objectives/adaptive_lam.py), and the options
# that configure it; a weight that takes lam declares them to allow it.
AUTO = "auto"
ADAPTIVE_LAM_OPTIONS = ("lam_momentum", "lam_init", "lam_steps")


class BoundWeight(NamedTuple):
    """A configured triplet or pair weight, checked once and called every step."""

    name: str
    fn: Callable
    options: dict[str, Any]
    takes_relative: bool

    @property
    def adaptive_lam(self) -> bool:
        """``lam: auto``: the objective passes its running ``lam`` at every call."""
        return self.options.get("lam") == AUTO

    def __str__(self) -> str:
        shown = [f"{k}={v}" for k, v in self.options.items()
                 if self.adaptive_lam or k not in ADAPTIVE_LAM_OPTIONS]
        return f"{self.name}({', '.join(shown)})"


def _check_lam(where: str, slot: str, name: str, options: Mapping[str, Any],
               given: Mapping[str, Any]) -> None:
    """``lam: auto``'s options come with it only, on a pair weight that declares them, and
    lie in their ranges (their types are the registry's to check: :meth:`Registry.check`)."""
    adaptive_given = [key for key in ADAPTIVE_LAM_OPTIONS if key in given]
    if options["lam"] != AUTO:
        if adaptive_given:
            raise ValueError(f"{where}: {', '.join(adaptive_given)} (option(s) of lam: auto, "
                             f"mmgoal's adaptive lambda) would apply to nothing with lam: "
                             f"{options['lam']}; remove them or set lam: auto")
        return
    if slot != "pair":
        raise ValueError(f"{where}: lam: auto follows the scores of positives and hardest "
                         f"negatives, for pair weights only; give {name!r} a number")
    missing = [key for key in ADAPTIVE_LAM_OPTIONS if key not in options]
    if missing:
        raise ValueError(f"{where}: {name!r} takes lam but not {', '.join(missing)}, which "
                         f"lam: auto reads: give it keyword parameters {', '.join(missing)} "
                         f"with defaults (docs/objectives.md)")
    if not 0 <= options["lam_momentum"] < 1:
        raise ValueError(f"{where}: lam_momentum must be a number in [0, 1) (the weight of "
                         f"the running lam at each update; 0 takes each step's midpoint); "
                         f"got {options['lam_momentum']!r}")
    steps = options["lam_steps"]
    if steps is not None and steps < 1:
        raise ValueError(f"{where}: lam_steps must be a whole number >= 1 (the updates after "
                         f"which lam holds) or null (lam follows the scores for the whole run); "
                         f"got {steps!r}")


def bind_weight(slot: str, spec: str | Mapping[str, Any]) -> BoundWeight:
    """The weight of ``objective.triplet`` or ``objective.pair`` (``slot``), its options
    filled in and checked as any config (docs/objectives.md, "Configuring the weights").
    ``spec``: a registered name or ``{type: name, option: value, ...}``.

    Raises:
        UnknownNameError, ValueError: saying what to write.
    """
    registry = WEIGHT_REGISTRIES[slot]
    where = f"objective.{slot}"
    if isinstance(spec, str):
        spec = {"type": spec}
    if not isinstance(spec, Mapping) or not isinstance(spec.get("type"), str):
        raise ValueError(f"{where} must be a {registry.name} name ({', '.join(registry.names())}) "
                         f"or a mapping with a 'type' key and that weight's options, "
                         f"e.g. {{type: {registry.names()[0]}}}; got {spec!r}")
    registry.check(spec, where)
    name = spec["type"]
    given = {key: value for key, value in spec.items() if key != "type"}
    defaults = registry.defaults(name)
    takes_relative = "relative" in registry.inputs_of(name)
    if takes_relative and (slot != "pair" or "eps" not in defaults):
        raise ValueError(f"{where}: {name!r} takes relative, the multi-similarity comparison "
                         f"sets, which only pair weights get and which are built with the "
                         f"weight's own eps option: give it an eps parameter")
    options = {key: given[key] if key in given else defaults[key]
               for key in registry.parameters(name)[0]}
    if "lam" in options:
        _check_lam(where, slot, name, options, given)
    return BoundWeight(name, registry.get(name), options, takes_relative)


def _misplaced_options_error(specs: Mapping[str, Any], misplaced: Mapping[str, Any]
                             ) -> ValueError:
    """The error for keys given at the objective level, e.g. the old flat ``tau: 5``."""
    moves, unknown = [], []
    for key, value in misplaced.items():
        targets = []
        for slot, registry in WEIGHT_REGISTRIES.items():
            takers = [name for name in registry.names() if key in registry.parameters(name)[0]]
            if takers:
                spec = specs[slot]
                chosen = spec.get("type") if isinstance(spec, Mapping) else spec
                name = chosen if chosen in takers else takers[0]
                targets.append(f"{slot}: {{type: {name}, {key}: {value}}} ({key} is an option "
                               f"of the {registry.name}(s) {', '.join(takers)})")
        if targets:
            moves.append(f"{key} -> " + " or ".join(targets))
        else:
            unknown.append(close_match_hints([key], ["triplet", "pair", "reduction"]))
    problems = []
    if moves:
        problems.append("GoalObjective got weight options at the objective level, where they "
                        "would apply to no weight in particular; move each under its weight: "
                        + "; ".join(moves))
    if unknown:
        problems.append(f"GoalObjective got unknown config key(s) {', '.join(unknown)}; it takes "
                        f"triplet, pair and reduction")
    return ValueError(". ".join(problems))


class GoalGradient(NamedTuple):
    """What :meth:`GoalObjective.tile_gradient` computes: ``loss`` (value the logged
    violation, gradient ``G``), ``violation`` (``sum T (s_n - s_p)`` of this rank's
    triplets); of the whole batch, ``weight_sum`` of the triplet weights, every
    ``positive_scores`` and every valid triplet's ``hardest`` negative score."""

    loss: torch.Tensor
    violation: torch.Tensor
    weight_sum: torch.Tensor
    positive_scores: torch.Tensor
    hardest: torch.Tensor


@OBJECTIVES.register()
class GoalObjective(nn.Module):
    """Triplet weight x pair weight, applied directly as the gradient of the scores.

    Args:
        triplet, pair: a ``TRIPLET_WEIGHTS`` / ``PAIR_WEIGHTS`` name (its default options)
            or a mapping with ``type`` and that weight's options, e.g. ``{type: cir, tau:
            10, cir_offset: 0.5}``; docs/objectives.md lists them, ``lam: auto`` included.
        reduction: ``sum`` over triplets (VSE++) or ``mean`` over positives.
        **misplaced: only to reject options given at the objective level (the old flat
            ``tau: 5``) with the nested form to write instead.

    ``forward`` returns ``goal_loss`` (value the violation, gradient ``G``),
    ``active_fraction``, ``positive_median``, ``negative_median`` and, with ``lam: auto``,
    ``lam`` (docs/objectives.md, "Choosing a combination and lam"); ``adaptive_lam`` holds
    that running ``lam``, else None.
    """

    def __init__(self, triplet: str | Mapping[str, Any] = "con",
                 pair: str | Mapping[str, Any] = "con", reduction: Reduction = "sum",
                 **misplaced: Any) -> None:
        super().__init__()
        if misplaced:
            raise _misplaced_options_error({"triplet": triplet, "pair": pair}, misplaced)
        # Bound once: inspecting signatures every step would sit on the hot path.
        self.triplet_weight = bind_weight("triplet", triplet)
        self.pair_weight = bind_weight("pair", pair)
        self.reduction = reduction
        options = self.pair_weight.options
        self.adaptive_lam = (AdaptiveLam(options["lam_momentum"], options["lam_init"],
                                         options["lam_steps"])
                             if self.pair_weight.adaptive_lam else None)

    def extra_repr(self) -> str:
        return f"triplet={self.triplet_weight}, pair={self.pair_weight}, reduction={self.reduction}"

    def tile_gradient(self, tiles: ScoreTiles) -> GoalGradient:
        """``G = dl/dS`` of this rank's triplets, put on the scores of their O(n) pairs: one
        pass over the tiles mines the hardest negatives and ``R-`` sums; the O(n) batch-wide
        numbers are gathered, so the ranks' ``G`` sum to one process's."""
        triplet, pair = self.triplet_weight, self.pair_weight
        positives = {"i2t": tiles.pair_scores(tiles.positive_rows, tiles.positive_cols),
                     "t2i": tiles.pair_scores(tiles.own_positive_rows, tiles.own_positive_cols)}
        positive_scores = tiles.gather(positives["i2t"].detach())
        pair_kwargs = dict(pair.options)
        if self.adaptive_lam is not None:
            pair_kwargs["lam"] = self.adaptive_lam.value
        hardest, asked, sums = HardestNegative(), NegativeSums(), {}
        if pair.takes_relative:  # what R- needs, asked of the weight on one dummy triplet
            one = positive_scores.new_zeros(1)
            pair.fn(one, one, **{**pair_kwargs,
                                 "relative": RelativeScores(one, one, one, 0.0, asked)})
            threshold = (positive_scores.min() if len(positive_scores)
                         else positive_scores.new_tensor(math.inf)) - pair.options["eps"]
            sums = negative_set_statistics(asked, threshold)
        tiles.statistics(hardest, *sums.values())
        mined = mine_triplets(tiles, hardest)
        divisor = max(tiles.positive_count, 1) if self.reduction == "mean" else 1
        violation = positive_scores.new_zeros(())
        surrogate = positive_scores.new_zeros(())
        weight_sum = positive_scores.new_zeros(())
        own_hardest = []
        for triplets in mined:
            rows = triplets.direction == "i2t"
            anchors = triplets.anchors - (tiles.rows.start if rows else 0)
            s_p = positives[triplets.direction]
            s_n = tiles.pair_scores(*triplets.negative_pairs())
            # the mined negative's score as the tiles gave it (the R- sums are of those)
            values = (hardest.row_value if rows else hardest.col_value)[anchors]
            p, n = s_p.detach(), torch.where(triplets.valid, values, s_n.detach())
            t = triplet.fn(p, n, **triplet.options) * triplets.valid
            if pair.takes_relative:
                pair_kwargs["relative"] = RelativeScores(
                    p, n, positive_scores, pair.options["eps"],
                    negative_sums(asked, sums, rows, anchors))
            w_pos, w_neg = pair.fn(p, n, **pair_kwargs)
            surrogate = surrogate + ((-t * w_pos) * s_p).sum() / divisor \
                + ((t * w_neg) * s_n).sum() / divisor
            violation += (t * (n - p)).sum() / divisor
            weight_sum += t.sum()
            own_hardest.append(n[triplets.valid])
        own_hardest = torch.cat(own_hardest)
        if self.adaptive_lam is not None and self.training:
            self.adaptive_lam.observe(positives["i2t"].detach(), own_hardest)
        # value: the logged violation; gradient: exactly G (times the incoming gradient)
        loss = violation.detach() + surrogate - surrogate.detach()
        return GoalGradient(loss, violation, tiles.total(weight_sum), positive_scores,
                            tiles.gather(own_hardest))

    def gradient(self, sims: torch.Tensor, positives: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """``G = dl/dS`` of a whole score matrix as a dense (n_img, n_txt) tensor (float32,
        or float64 for float64 scores), the logged violation, the mean triplet weight and
        the score medians (:meth:`forward`'s statistics)."""
        scores = sims.detach().to(torch.promote_types(sims.dtype, torch.float32))
        scores.requires_grad_()
        tiles = ScoreTiles(MatrixScorer(scores), *scores.shape,
                           positives=check_positives(scores, positives))
        result = self.tile_gradient(tiles)
        (grad,) = torch.autograd.grad(result.loss, scores, allow_unused=True)
        grad = torch.zeros_like(scores) if grad is None else grad
        return (grad.detach(), result.violation, *self._statistics(result))

    @staticmethod
    def _statistics(result: GoalGradient) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The mean triplet weight (over both directions of every positive) and the
        medians of the positive and hardest-negative scores (none without a triplet)."""
        mean_weight = result.weight_sum / max(2 * len(result.positive_scores), 1)
        medians = ({"positive_median": result.positive_scores.median(),
                    "negative_median": result.hardest.median()} if len(result.hardest) else {})
        return mean_weight, medians

    works_on_tiles = True  # every anchor's triplets come from its row or column's tiles

    def forward(self, inputs: ObjectiveInputs) -> dict[str, torch.Tensor]:
        tiles = score_tiles(inputs)
        result = self.tile_gradient(tiles)
        mean_weight, medians = self._statistics(result)
        outputs = {"goal_loss": result.loss.to(tiles.scorer.dtype), "active_fraction": mean_weight,
                   **medians}
        if self.adaptive_lam is not None:
            outputs["lam"] = torch.tensor(self.adaptive_lam.value, device=tiles.device)
        return outputs

    def finish_step(self, applied: bool) -> None:
        """After every optimisation step (the strategies call it on every rank): ``lam:
        auto`` takes the step's statistics when ``applied``; nothing for a fixed ``lam``."""
        if self.adaptive_lam is not None:
            self.adaptive_lam.finish_step(applied)
