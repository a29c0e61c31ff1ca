"""GOAL: objectives defined by their gradient (Xuan & Chen, WACV 2023).

Every triplet-family loss has the gradient ``T(s_p, s_n) * P+`` on the positive
and ``T(s_p, s_n) * P-`` on the negative of each hardest-negative triplet
(docs/reference/goal.md). ``GoalObjective`` assembles that gradient ``G =
dl/dS`` for any triplet weight x pair weight, including the combinations that
no loss integrates to, and hands it to autograd through :class:`_GradientIs`, an
autograd function whose backward writes ``G``'s O(n) entries, scaled by whatever
gradient flows in (loss scaling, accumulation), into one (n_img, n_txt) tensor: no
dense ``G`` is formed in the forward pass. Autograd carries it on into the encoders
(for a dual encoder ``dl/dx_i = sum_j G[i, j] y_j``, the paper's eq. 2-4). Unlike the
authors' code it honours the incoming gradient, handles several positives per row, and
has no Python loop over the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from mmgoal.config import close_match_hints
from mmgoal.objectives.adaptive_lam import AdaptiveLam
from mmgoal.objectives.hard_negative import check_reduction
from mmgoal.objectives.mining import check_positives, mine_direction, score_share
from mmgoal.objectives.weights import RelativeScores
from mmgoal.registry import OBJECTIVES, PAIR_WEIGHTS, TRIPLET_WEIGHTS
from mmgoal.structures import ObjectiveInputs, ScoreShare

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
    """Look up the weight of ``objective.triplet`` or ``objective.pair`` and check its options.

    A weight's options are its keyword parameters after the call-time inputs its
    registry declares (the scores ``s_p``, ``s_n`` and a pair weight's ``relative``);
    the registry checks them as it checks any component's config
    (:meth:`~mmgoal.registry.Registry.check`).

    Args:
        slot: ``triplet`` or ``pair``.
        spec: a registered weight name (its default options), or a mapping
            ``{type: name, option: value, ...}`` whose other keys are options of
            that weight.

    Returns:
        The weight with every option it takes, defaults filled in.

    Raises:
        UnknownNameError: the name is not registered (a ``KeyError`` and a
            ``ValueError``; the message lists the names and the closest one).
        ValueError: ``spec`` is neither a name nor a mapping with a ``type``, it
            sets an option the weight does not take (with the closest option) or of
            the wrong type, or leaves out one without a default; a pair weight takes
            ``relative`` but no ``eps``; ``lam: auto``'s options are out of range,
            come without it, or it is set where it cannot apply.
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


class GradientEntries(NamedTuple):
    """A sparse ``G``: ``G[rows[k], cols[k]] += values[k]`` (an index may repeat)."""

    rows: torch.Tensor
    cols: torch.Tensor
    values: torch.Tensor
    shape: tuple[int, int]

    def dense(self, scale: torch.Tensor | None = None) -> torch.Tensor:
        """``G`` (times ``scale``, a scalar) in the values' dtype, written once."""
        values = self.values if scale is None else self.values * scale.to(self.values.dtype)
        grad = self.values.new_zeros(self.shape)
        return grad.index_put_((self.rows, self.cols), values, accumulate=True)


class _GradientIs(torch.autograd.Function):
    """``value`` (the logged violation) forward; ``G`` times the incoming gradient backward.

    It replaces the surrogate ``(G.detach() * S).sum()``, whose forward multiplied and
    summed a dense ``G`` and whose backward multiplied it again: here the backward
    writes the entries, scaled by the incoming (scalar) gradient, into one tensor of
    each score tensor's shape (the score matrix; under local scoring the rank's rows and
    its columns).
    """

    @staticmethod
    def forward(ctx, value: torch.Tensor, entries: tuple[GradientEntries, ...],
                *scores: torch.Tensor) -> torch.Tensor:
        ctx.entries, ctx.dtypes = entries, [tensor.dtype for tensor in scores]
        return value.clone()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return None, None, *(entries.dense(grad_output).to(dtype)
                             for entries, dtype in zip(ctx.entries, ctx.dtypes))


class GoalGradient(NamedTuple):
    """What :meth:`GoalObjective.share_gradient` computes for one share of the scores.

    Attributes:
        scores: the score tensors ``G`` is the gradient of (the matrix; under local
            scoring the rank's rows and columns), with ``entries``, ``G``'s nonzero
            entries in each.
        violation: the weighted violation ``sum T (s_n - s_p)`` of the share's triplets.
        weight_sum: the sum of their triplet weights.
        positive_scores: every positive pair's score, of the whole batch.
        hardest: every valid triplet's hardest-negative score, of the whole batch.
    """

    scores: tuple[torch.Tensor, ...]
    entries: tuple[GradientEntries, ...]
    violation: torch.Tensor
    weight_sum: torch.Tensor
    positive_scores: torch.Tensor
    hardest: torch.Tensor


@OBJECTIVES.register()
class GoalObjective(nn.Module):
    """Triplet weight x pair weight, applied directly as the gradient of the scores.

    Each weight is a registered name (its default options) or a mapping with
    ``type`` and options of that weight only, e.g. ``triplet: {type: cir, tau:
    10, cir_offset: 0.5}`` (docs/objectives.md lists every weight's options).

    Args:
        triplet: a ``TRIPLET_WEIGHTS`` entry: ``con`` (``margin``), ``nca``
            (``tau``: the paper's figures 10, released code 1), ``cir`` (``tau``,
            ``cir_offset``: released code 0.5, paper 0).
        pair: a ``PAIR_WEIGHTS`` entry: ``con``, ``lin`` (``lin_shift``), ``sig``
            (``alpha``, ``beta``, ``lam``), ``lin_ms`` (``lin_shift``, ``eps``),
            ``sig_ms`` (``alpha``, ``beta``, ``lam``, ``eps``). ``eps``, the
            multi-similarity comparison margin, builds the ``relative`` sets.
            ``lam: auto`` (``sig``, ``sig_ms``; with ``lam_momentum``,
            ``lam_init``, ``lam_steps``) is mmgoal's adaptive lambda, not the
            paper's: a moving average of the midpoint between the median
            positive and the median hardest-negative score over the first
            ``lam_steps`` optimisation steps, then held
            (:mod:`mmgoal.objectives.adaptive_lam`, docs/objectives.md).
        reduction: ``sum`` over triplets (VSE++) or ``mean`` over positives.
        **misplaced: accepted only to reject weight options given at the
            objective level (the old flat form ``tau: 5``) with the nested form
            to write instead; any key here is a ``ValueError``.

    Returns (from ``forward``): ``goal_loss``, whose value is the weighted
    violation ``sum T * (s_n - s_p)`` (for logging; it is not a loss whose
    gradient is ``G``) and whose gradient is ``G``; ``active_fraction``, the
    mean triplet weight; ``positive_median`` and ``negative_median``, the median
    positive score and the median hardest-negative score of the valid triplets
    (both directions; left out when no triplet is valid), which show where a fixed
    ``lam`` sits against the scores (docs/objectives.md, "Choosing a combination and
    lam"); with ``lam: auto``, ``lam``, the value this call used.

    Attributes:
        adaptive_lam: the running ``lam`` of ``lam: auto`` (its state is
            checkpointed with the objective); ``None`` for a fixed ``lam``.
    """

    def __init__(self, triplet: str | Mapping[str, Any] = "con",
                 pair: str | Mapping[str, Any] = "con", reduction: str = "sum",
                 **misplaced: Any) -> None:
        super().__init__()
        if misplaced:
            raise _misplaced_options_error({"triplet": triplet, "pair": pair}, misplaced)
        # Bound once: inspecting signatures every step would sit on the hot path.
        self.triplet_weight = bind_weight("triplet", triplet)
        self.pair_weight = bind_weight("pair", pair)
        self.reduction = check_reduction(reduction)
        options = self.pair_weight.options
        self.adaptive_lam = (AdaptiveLam(options["lam_momentum"], options["lam_init"],
                                         options["lam_steps"])
                             if self.pair_weight.adaptive_lam else None)

    def extra_repr(self) -> str:
        return f"triplet={self.triplet_weight}, pair={self.pair_weight}, reduction={self.reduction}"

    @torch.no_grad()
    def share_gradient(self, share: ScoreShare) -> GoalGradient:
        """``G = dl/dS``'s nonzero entries on a share of the scores, with its statistics.

        Each direction's triplets are its anchors' (the share's image rows, its text
        columns), so ``G``'s entries lie in the share; the batch-wide numbers the weights
        read (the positive scores of ``R+``, the threshold of ``R-``, ``lam: auto``'s
        medians) are O(n) and gathered (:attr:`ScoreShare.gather`). Under local scoring
        the shares' ``G`` sum to one process's.

        ``G`` is nonzero only at the positives and the mined negatives, so it is kept
        as their entries (O(n) values) until the backward pass writes it once: no dense
        ``G`` is formed, multiplied or summed in the forward pass. Weights are computed in
        float32 from the detached scores whatever their dtype (float64 scores keep
        float64), so bf16/fp16 training gets exact weights.
        """
        dtype = torch.promote_types(share.rows.dtype, torch.float32)
        rows = share.rows.detach().to(dtype)
        whole = share.one_matrix
        columns = rows if whole else share.columns.detach().to(dtype)
        sides = (("i2t", rows, share.row_positives, rows, share.row_positives),
                 ("t2i", columns, share.column_positives, columns.T, share.column_positives.T))
        mined = []
        for direction, scores, positives, block, block_positives in sides:
            triplets = mine_direction(block, block_positives)
            mined.append((direction, scores, positives, triplets, *triplets.scores(block)))
        own_positives = mined[0][4]  # the i2t triplets hold every positive pair once
        own_hardest = torch.cat([s_n[triplets.valid] for *_, triplets, _, s_n in mined])
        positive_scores, hardest = share.gather(own_positives), share.gather(own_hardest)
        triplet, pair = self.triplet_weight, self.pair_weight
        pair_kwargs = dict(pair.options)
        if self.adaptive_lam is not None:
            pair_kwargs["lam"] = self.adaptive_lam.value
            if self.training:
                self.adaptive_lam.observe(own_positives, own_hardest)
        divisor = max(share.positive_count, 1) if self.reduction == "mean" else 1
        violation, weight_sum = rows.new_zeros(()), rows.new_zeros(())
        entries = {}  # id(score tensor) -> its (rows, cols, values)
        shared: dict = {}  # per-anchor sums the two directions' comparison sets share
        for direction, scores, positives, triplets, s_p, s_n in mined:
            t = triplet.fn(s_p, s_n, **triplet.options) * triplets.valid
            if pair.takes_relative:
                pair_kwargs["relative"] = RelativeScores(
                    scores, positives, direction, triplets.anchors, s_p, s_n, positive_scores,
                    pair.options["eps"], shared)
            w_pos, w_neg = pair.fn(s_p, s_n, **pair_kwargs)
            anchors = torch.cat([triplets.anchors, triplets.anchors])
            others = torch.cat([triplets.others, triplets.negatives])
            where = (anchors, others) if direction == "i2t" else (others, anchors)
            entries.setdefault(id(scores), []).append(
                (*where, torch.cat([-t * w_pos, t * w_neg]) / divisor))
            violation += (t * (s_n - s_p)).sum() / divisor
            weight_sum += t.sum()
        sources = (share.rows,) if whole else (share.rows, share.columns)
        sparse = tuple(GradientEntries(*(torch.cat(part) for part in zip(*found)),
                                       tuple(source.shape))
                       for source, found in zip(sources, entries.values()))
        return GoalGradient(sources, sparse, violation, share.total(weight_sum),
                            positive_scores, hardest)

    def gradient(self, sims: torch.Tensor, positives: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """``G = dl/dS`` of a whole score matrix as a dense (n_img, n_txt) tensor (float32,
        or float64 for float64 scores), the logged violation, the mean triplet weight and
        the score medians (:meth:`forward`'s statistics)."""
        result = self.share_gradient(ScoreShare.whole(sims, check_positives(sims, positives)))
        return (result.entries[0].dense(), result.violation, *self._statistics(result))

    @staticmethod
    def _statistics(result: GoalGradient) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The mean triplet weight (over both directions of every positive) and the
        medians of the positive and hardest-negative scores (none without a triplet)."""
        mean_weight = result.weight_sum / max(2 * len(result.positive_scores), 1)
        medians = ({"positive_median": result.positive_scores.median(),
                    "negative_median": result.hardest.median()} if len(result.hardest) else {})
        return mean_weight, medians

    works_on_rows = True  # each direction's triplets are its anchors' (ScoreShare)

    def forward(self, inputs: ObjectiveInputs) -> dict[str, torch.Tensor]:
        share = score_share(inputs)
        result = self.share_gradient(share)
        # value: the logged violation; gradient: exactly G (times the incoming gradient)
        loss = _GradientIs.apply(result.violation.to(share.rows.dtype), result.entries,
                                 *result.scores)
        mean_weight, medians = self._statistics(result)
        outputs = {"goal_loss": loss, "active_fraction": mean_weight, **medians}
        if self.adaptive_lam is not None:
            outputs["lam"] = torch.tensor(self.adaptive_lam.value, device=share.rows.device)
        return outputs

    def finish_step(self, applied: bool) -> None:
        """After every optimisation step (the strategies call it on every rank): ``lam:
        auto`` takes the step's statistics when ``applied``; nothing for a fixed ``lam``."""
        if self.adaptive_lam is not None:
            self.adaptive_lam.finish_step(applied)
