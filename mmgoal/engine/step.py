"""The training computation of one batch as one ``nn.Module`` (model, objective and
constraints its children), which DeepSpeed and data-parallel wrappers train.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

import torch
from torch import nn

from mmgoal.contract import averages_pairs, works_on_tiles
from mmgoal.distributed import (
    gather,
    gather_groups,
    global_losses,
    rng_state,
    set_rng_state,
    world_info,
)
from mmgoal.objectives.mining import positives_from_groups
from mmgoal.scoring import ScoreTiles, scorer_for
from mmgoal.structures import ObjectiveInputs, cat_features

logger = logging.getLogger(__name__)


class TrainingStep(nn.Module):
    """Model + objective + constraints; ``forward(batch)`` gives the batch's losses.

    With several processes (``gather``) the objective sees the global batch. An objective
    that ``works_on_tiles`` reads :class:`~mmgoal.scoring.ScoreTiles`, under ``local``
    scoring only this rank's rows (docs/distributed.md, "Local scoring"); any other gets
    the whole global score matrix on every rank. ``scoring``, ``grad_cache_chunk``
    (docs/distributed.md, "Gradient caching") and ``tile_rows``/``tile_cols`` are
    ``train``'s keys.
    """

    def __init__(self, model: nn.Module, objective: nn.Module,
                 constraints: list[nn.Module] | None = None, gather: bool = True,
                 scoring: str = "local", grad_cache_chunk: int | None = None,
                 tile_rows: int | None = None, tile_cols: int | None = None) -> None:
        super().__init__()
        self.model = model
        self.objective = objective
        self.constraints = nn.ModuleList(constraints or [])
        self.gather = gather
        self.scoring = scoring
        self.grad_cache_chunk = grad_cache_chunk
        self.tile = (tile_rows, tile_cols)
        self._said_whole: set[str] = set()  # objectives whose whole matrix was said

    def encode(self, batch: dict) -> tuple:
        """The batch's image and text features (the towers' work)."""
        return self.model.encode_image(batch), self.model.encode_text(batch)

    def forward(self, batch: dict, objective: nn.Module | None = None,
                replay: tuple[CachedGradients, int] | None = None) -> dict[str, torch.Tensor]:
        """The objective's and constraints' outputs of ``batch`` under ``objective``
        (default: the configured one), plus ``loss``, the sum of every ``*_loss``.
        ``replay`` (``(cache, k)``): only chunk ``k``'s surrogate (:meth:`replay_chunk`)."""
        if replay is not None:
            return {"loss": self.replay_chunk(batch, *replay)}
        return self.losses(batch, *self.encode(batch), objective)

    def losses(self, batch: dict, image_features, text_features,
               objective: nn.Module | None = None) -> dict[str, torch.Tensor]:
        """:meth:`forward`'s losses from the batch's features."""
        objective = self.objective if objective is None else objective
        groups = batch["image_groups"]
        all_images, all_texts = image_features, text_features
        features = dict(image_features=all_images, text_features=all_texts,
                        local_image_features=image_features,
                        local_text_features=text_features, batch=batch, model=self.model)
        rank, world = world_info()
        gathered = self.gather and world > 1
        if gathered:
            all_images = gather(image_features)
            all_texts = gather(text_features)
            groups = gather_groups(batch["image_ids"], device=groups.device)
            features.update(image_features=all_images, text_features=all_texts)
        if works_on_tiles(objective):
            sharded = gathered and self.scoring == "local"
            own = slice(rank * len(batch["image_groups"]),
                        (rank + 1) * len(batch["image_groups"])) if sharded else None
            tiles = ScoreTiles(scorer_for(self.model, all_images, all_texts),
                               len(groups), len(groups), groups, rows=own, own_texts=own,
                               tile_rows=self.tile[0], tile_cols=self.tile[1])
            outputs = objective(ObjectiveInputs(None, tiles=tiles, **features))
            if sharded:
                outputs = global_losses(outputs, world)
        else:
            name = type(objective).__name__
            if name not in self._said_whole:
                self._said_whole.add(name)
                logger.info("%s works on the whole score matrix (it declares no "
                            "works_on_tiles): the %d x %d scores of the batch are built on "
                            "every rank (docs/plugins.md)", name, len(groups), len(groups))
            # Per-pair objectives (MLM, box grounding) take this rank's own pairs.
            outputs = objective(ObjectiveInputs(
                self.model.similarity(all_images, all_texts), positives_from_groups(groups),
                **features))
        if len(self.constraints):  # image b and text b of a training batch are a matched pair
            attention = self.model.attention(image_features, text_features)
            for constraint in self.constraints:
                parts = constraint(attention)  # of this rank's pairs: made the global batch's
                if self.gather and world > 1:
                    parts = global_losses(parts, world, parts_are_means=averages_pairs(constraint),
                                          statistics=True)
                outputs.update(parts)
        outputs["loss"] = sum(v for k, v in outputs.items() if k.endswith("_loss"))
        return outputs

    def part_shape(self, micro_batch: int) -> tuple[int, int]:
        """How many parts :meth:`parts` makes of a micro-batch of ``micro_batch`` pairs, and
        the pairs of the largest."""
        if self.grad_cache_chunk is None:
            return 1, micro_batch
        return math.ceil(micro_batch / self.grad_cache_chunk), min(self.grad_cache_chunk,
                                                                   micro_batch)

    def parts(self, batch: dict, objective: nn.Module | None = None,
              loss_scale: float = 1.0) -> MicroBatchParts:
        """How a strategy runs ``batch``: one part, the batch itself, or under
        ``grad_cache_chunk`` the cached losses and each chunk's replay (the strategies'
        single forward-backward seam)."""
        if self.grad_cache_chunk is None:
            return MicroBatchParts(None, [None])
        outputs, cache = self.cache_gradients(batch, objective, loss_scale)
        return MicroBatchParts(outputs, [(cache, index) for index in range(len(cache.chunks))],
                               cache)

    # ------------------------------------------------------------ gradient caching
    def cache_gradients(self, batch: dict, objective: nn.Module | None = None,
                        loss_scale: float = 1.0) -> tuple[dict[str, torch.Tensor],
                                                          CachedGradients]:
        """The first half of a gradient-cached step (GradCache, Gao et al. 2021; steps 1-2
        of docs/distributed.md, "Gradient caching"): the detached losses and the cache.

        The gradients are of the loss times the fp16 ``loss_scale`` (no underflow), kept
        unscaled in float32 at least; the parameters get nothing yet.
        """
        refuse_batch_norm(self.model)
        count = len(batch["image_groups"])
        chunks = [(start, min(start + self.grad_cache_chunk, count))
                  for start in range(0, count, self.grad_cache_chunk)]
        states, images, texts = [], [], []
        with torch.no_grad():
            for start, stop in chunks:
                states.append(rng_state())
                image, text = self.encode(slice_batch(batch, start, stop, count))
                images.append(image)
                texts.append(text)
        image_features, text_features = leaf_features(images), leaf_features(texts)
        outputs = self.losses(batch, image_features, text_features, objective)
        image_leaves, text_leaves = feature_tensors(image_features), feature_tensors(text_features)
        leaves = [*image_leaves, *text_leaves]
        params = [p for p in self.parameters() if p.requires_grad]
        grads = torch.autograd.grad(outputs["loss"] * loss_scale, leaves + params,
                                    allow_unused=True)
        unscaled = [None if g is None else at_least_float32(g) / loss_scale for g in grads]
        cache = CachedGradients(
            chunks, states, rng_state(), unscaled[:len(image_leaves)],
            unscaled[len(image_leaves):len(leaves)],
            [(p, g) for p, g in zip(params, unscaled[len(leaves):]) if g is not None])
        return {key: value.detach() for key, value in outputs.items()}, cache

    def replay_chunk(self, batch: dict, cache: CachedGradients, index: int) -> torch.Tensor:
        """Chunk ``index`` encoded again, its random state replayed, as the surrogate
        ``sum(features * cached gradient)`` (step 3 of docs/distributed.md, "Gradient
        caching"); the last chunk adds the directly read parameters' gradients and
        restores the random state :meth:`cache_gradients` left."""
        start, stop = cache.chunks[index]
        set_rng_state(cache.rng[index])
        image, text = self.encode(slice_batch(batch, start, stop, len(batch["image_groups"])))
        surrogate = 0.0
        for features, grads in ((image, cache.image_grads), (text, cache.text_grads)):
            for tensor, grad in zip(feature_tensors(features), grads):
                if grad is not None:
                    part = grad[(slice(start, stop), *map(slice, tensor.shape[1:]))]
                    surrogate = surrogate + (at_least_float32(tensor) * part).sum()
        last = index == len(cache.chunks) - 1
        for param, grad in cache.direct:  # every chunk names them: DDP sees each used
            surrogate = surrogate + (at_least_float32(param) * (grad if last else 0 * grad)).sum()
        if last:
            set_rng_state(cache.rng_after)
        return surrogate


@dataclass
class MicroBatchParts:
    """A micro-batch as the strategies run it: each of ``replays`` is one forward through
    the strategy's wrapper (``replay=`` of :meth:`TrainingStep.forward`) and one backward;
    ``outputs`` are the losses to log, None until the single part without gradient caching
    has given them."""

    outputs: dict[str, torch.Tensor] | None
    replays: list[tuple[CachedGradients, int] | None]
    cache: CachedGradients | None = None


@dataclass
class CachedGradients:
    """What :meth:`TrainingStep.cache_gradients` keeps for the replays of its chunks.

    Attributes:
        rng: the random state before each chunk was encoded; rng_after: after the losses.
        image_grads, text_grads: per floating feature tensor (:func:`feature_tensors`),
            the loss's unscaled gradient, ``None`` where the loss does not read it.
        direct: the parameters read other than through the features, with gradients.
    """

    chunks: list[tuple[int, int]]
    rng: list[dict]
    rng_after: dict
    image_grads: list[torch.Tensor | None]
    text_grads: list[torch.Tensor | None]
    direct: list[tuple[nn.Parameter, torch.Tensor]]


def at_least_float32(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in float32, or as it is in float64: where cached gradients are kept."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


def slice_batch(batch: dict, start: int, stop: int, count: int) -> dict:
    """Pairs ``start:stop`` of a collated batch of ``count`` pairs: every tensor and list
    along the batch cut, anything else (a count of skipped samples) kept."""
    return {key: value[start:stop] if isinstance(value, (torch.Tensor, list, tuple))
            and len(value) == count else value for key, value in batch.items()}


def feature_tensors(features) -> list[torch.Tensor]:
    """The floating tensors of a features object (a tensor, or ``ImageFeatures``-like), in
    field order: what a gradient-cached step caches the gradient of."""
    if isinstance(features, torch.Tensor):
        return [features] if features.is_floating_point() else []
    return [value for field in dataclasses.fields(features)
            if isinstance(value := getattr(features, field.name), torch.Tensor)
            and value.is_floating_point()]


def leaf_features(parts: list):
    """The chunks' features concatenated (tokens padded to the widest chunk) into leaves
    that require a gradient, which the losses are computed on."""
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts).requires_grad_()
    whole = cat_features(parts)
    for tensor in feature_tensors(whole):
        tensor.requires_grad_()
    return whole


def refuse_batch_norm(model: nn.Module) -> None:
    """Gradient caching encodes a batch in chunks twice: a BatchNorm layer in training mode
    would normalise by each chunk's statistics and update its running ones twice."""
    training = [name for name, module in model.named_modules()
                if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training]
    if training:
        raise ValueError(f"train.grad_cache_chunk: the model has BatchNorm layers in training "
                         f"mode ({', '.join(training[:3])}{', ...' if len(training) > 3 else ''})"
                         f", which would normalise each chunk by its own statistics and update "
                         f"their running statistics twice a step; put them in eval mode "
                         f"(frozen statistics), use a model with LayerNorm or GroupNorm, or "
                         f"leave grad_cache_chunk unset")
