"""Processes: the launcher's world, the process group, this rank, random states, and the
gathers across ranks; the one place that answers the world size (below the engine,
objectives and evaluation: docs/architecture.md). Everything works in one process too.

Why the differentiable gather (open_clip's) needs no loss rescaling, for global and
per-rank losses alike: docs/distributed.md, "Objectives on the global batch".
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import math
import os
import random
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


def world_info() -> tuple[int, int]:
    """(rank, world size); (0, 1) when torch.distributed is not initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def launched_world_size() -> int:
    """The number of processes a launcher (torchrun, deepspeed, SLURM via them) started,
    before their group is joined (:func:`world_info` once it is)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_rank() -> int:
    """This process's rank as its launcher set it, before the group is joined."""
    return int(os.environ.get("RANK", "0"))


def process_group_backend(device: torch.device) -> str:
    """NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_process_group(timeout_minutes: float, device: torch.device) -> None:
    """Join the launcher's process group (gloo on CPU, NCCL on GPUs), once."""
    if dist.is_initialized() or launched_world_size() == 1:
        return
    missing = [k for k in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
               if k not in os.environ]
    if missing:
        raise RuntimeError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} but {', '.join(missing)} "
                           f"unset; start the run with torchrun or deepspeed (docs/distributed.md)")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(process_group_backend(device),
                            timeout=datetime.timedelta(minutes=timeout_minutes))


def rng_state() -> dict:
    """This process's random states: torch's, Python's and the current CUDA device's."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device's generator
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _all_gather_single(out: torch.Tensor, local: torch.Tensor) -> None:
    # one tensor in, one out: torch 2.14's name, else torch 2.6's
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, local)


def _reduce_scatter_single(mine: torch.Tensor, grad: torch.Tensor) -> None:
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(mine, grad)


class _AllGather(torch.autograd.Function):
    """all_gather whose backward is a reduce-scatter: each rank receives the sum over ranks
    of the gradient of its own slice, and moves half the bytes of an all-reduce of the
    whole gradient (``torch.distributed.nn``'s rule, without its deprecated list API)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor) -> torch.Tensor:
        world = world_info()[1]
        out = local.new_empty((world * local.shape[0], *local.shape[1:]))
        _all_gather_single(out, local.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        world = world_info()[1]
        mine = grad.new_empty((grad.shape[0] // world, *grad.shape[1:]))
        _reduce_scatter_single(mine, grad.contiguous())
        return mine


def _shapes(tensors: Sequence[torch.Tensor]) -> list[list[torch.Size]]:
    """Every rank's shapes of ``tensors`` (the same number, of the same ranks, on every
    rank), in one collective: ``shapes[rank][i]``."""
    sizes = torch.tensor([size for t in tensors for size in t.shape], dtype=torch.long,
                         device=tensors[0].device)
    parts = [torch.empty_like(sizes) for _ in range(world_info()[1])]
    dist.all_gather(parts, sizes)
    shapes = []
    for part in parts:
        values, rank_shapes = part.tolist(), []
        for t in tensors:
            rank_shapes.append(torch.Size(values[:t.dim()]))
            values = values[t.dim():]
        shapes.append(rank_shapes)
    return shapes


def _same_shapes(local: torch.Tensor) -> list[torch.Size]:
    return [rank_shapes[0] for rank_shapes in _shapes([local])]


def check_equal_shapes(*tensors: torch.Tensor) -> None:
    """Raise a ``RuntimeError`` unless every rank holds ``tensors`` of the same shapes
    (one small collective), before a gather of different shapes aborts the group."""
    if world_info()[1] == 1:
        return
    shapes = _shapes(list(tensors))
    if any(rank_shapes != shapes[0] for rank_shapes in shapes):
        raise RuntimeError(f"every rank must gather tensors of the same shapes, got "
                           f"{[[tuple(s) for s in rank] for rank in shapes]} (rank by rank); "
                           f"drop partial batches")


def gather_with_grad(local: torch.Tensor, pad_dim: int | None = None,
                     shapes: Sequence[torch.Size] | None = None) -> torch.Tensor:
    """(B, ...) per rank -> (world * B, ...) in rank order, differentiable.

    Every rank needs the same number of rows and, without ``pad_dim``, the same shape,
    unchecked so that a gather is one collective. ``pad_dim`` (token counts) is
    zero-padded to the largest rank after a shape exchange, unless ``shapes`` (every
    rank's, from :func:`gather_features`) are given.
    """
    rank, world = world_info()
    if world == 1:
        return local
    if pad_dim is not None:
        shapes = shapes if shapes is not None else _same_shapes(local)
        width = max(s[pad_dim] for s in shapes)
        if local.shape[pad_dim] < width:
            pad = [0, 0] * (local.dim() - pad_dim - 1) + [0, width - local.shape[pad_dim]]
            local = torch.nn.functional.pad(local, pad)
        rows = {s[0] for s in shapes}
        if len(rows) > 1:
            raise RuntimeError(f"gather_with_grad needs the same number of rows on every "
                               f"rank, got {[s[0] for s in shapes]}; drop partial batches")
    if local.dtype == torch.bool:  # gloo cannot gather bool
        return _AllGather.apply(local.to(torch.uint8)).bool()
    return _AllGather.apply(local)


@torch.no_grad()
def gather_varying_length(local: torch.Tensor) -> torch.Tensor:
    """(n_r,) per rank -> (n_0 + n_1 + ...,) in rank order, on every rank; no gradient."""
    if world_info()[1] == 1:
        return local
    lengths = [shape[0] for shape in _same_shapes(local)]
    if not max(lengths):
        return local
    padded = local.new_zeros(max(lengths))
    padded[:len(local)] = local
    parts = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(parts, padded)
    return torch.cat([part[:length] for part, length in zip(parts, lengths)])


def sum_over_ranks(local: torch.Tensor) -> torch.Tensor:
    """``local`` summed over every rank, on every rank (a new tensor; no gradient)."""
    total = local.detach().clone()
    if world_info()[1] > 1:
        dist.all_reduce(total)
    return total


def _token_like(value: torch.Tensor) -> bool:
    """Tokens (B, L, ...) or a (B, L) bool mask: padded along L to the longest rank."""
    return value.dim() >= 3 or (value.dim() == 2 and value.dtype == torch.bool)


def gather_features(features: Any) -> Any:
    """A tensor or ``ImageFeatures``-like dataclass gathered along the batch; tokens and
    masks padded along dim 1 to the longest rank (one shape exchange for them all)."""
    if world_info()[1] == 1:
        return features
    if isinstance(features, torch.Tensor):
        return gather_with_grad(features, pad_dim=1 if features.dim() >= 2 else None)
    if not dataclasses.is_dataclass(features):
        raise TypeError(f"cannot gather features of type {type(features).__name__}; give "
                        f"tensors or a dataclass of tensors (ImageFeatures, TextFeatures)")
    values = {field.name: getattr(features, field.name) for field in dataclasses.fields(features)}
    padded = [name for name, value in values.items()
              if isinstance(value, torch.Tensor) and _token_like(value)]
    shapes = _shapes([values[name] for name in padded]) if padded else []
    for name, value in values.items():
        if name in padded:
            index = padded.index(name)
            values[name] = gather_with_grad(value, pad_dim=1,
                                            shapes=[rank[index] for rank in shapes])
        elif isinstance(value, torch.Tensor):
            values[name] = gather_with_grad(value)
    return type(features)(**values)


def id_hashes(image_ids: Sequence, device: torch.device | str = "cpu") -> torch.Tensor:
    """(B,) int64 stable hashes of image ids: equal ids, equal numbers, on every rank."""
    return torch.tensor([int.from_bytes(hashlib.blake2b(str(i).encode(), digest_size=8).digest(),
                                        "little", signed=True) for i in image_ids],
                        dtype=torch.long, device=device)


def gather_groups(image_ids: Sequence, device: torch.device | str = "cpu") -> torch.Tensor:
    """(world * B,) group numbers of the global batch on ``device`` (NCCL gathers on the
    GPU): positives are equal image ids."""
    return gather_with_grad(id_hashes(image_ids, device))


def rank_share(count: int, rank: int, world: int, unit: int = 1) -> tuple[int, int]:
    """``(start, end)``: rank ``rank``'s contiguous share of ``count`` items dealt out in
    whole units of ``unit`` items (batches, blocks), so that each unit is the one a single
    process would form and computes bit for bit the same."""
    units = math.ceil(count / unit)
    return (min(rank * units // world * unit, count),
            min((rank + 1) * units // world * unit, count))


def _field_specs(local: Any) -> tuple[list, dict[str, torch.Tensor | None]]:
    """Every rank's ``(type, {field: (shape, dtype name) or None})`` (``None`` for a rank
    without ``local``), exchanged in one collective (none in one process), and this rank's
    tensor fields."""
    fields = _tensor_fields(local)
    spec = None if local is None else (type(local), {
        name: None if t is None else (tuple(t.shape), str(t.dtype).removeprefix("torch."))
        for name, t in fields.items()})
    world = world_info()[1]
    if world == 1:
        return [spec], fields
    specs: list = [None] * world
    dist.all_gather_object(specs, spec)
    return specs, fields


def _assemble(kind: type, fields: dict[str, torch.Tensor | None]) -> Any:
    """A gathered value of the type the ranks hold: a tensor, or the dataclass of ``fields``."""
    return fields["tensor"] if kind is torch.Tensor or issubclass(kind, torch.Tensor) \
        else kind(**fields)


def wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor of ``dtype`` travels as in a collective: bool as uint8 (gloo
    cannot send bool)."""
    return torch.uint8 if dtype == torch.bool else dtype


@torch.no_grad()
def gather_uneven(local: Any, device: torch.device | str | None = None) -> list[Any]:
    """Every rank's ``local`` on every rank, in rank order; no gradient (evaluation's).

    ``local``: a tensor or feature dataclass whose shapes may differ across ranks in
    every dimension, or ``None`` on a rank with an empty share (``device`` then places
    its part of the collective: the GPU under NCCL).
    """
    world = world_info()[1]
    if world == 1:
        return [local]
    specs, fields = _field_specs(local)
    kind, known = next(spec for spec in specs if spec is not None)
    present = [t for t in fields.values() if t is not None]
    device = present[0].device if present else torch.device(device or "cpu")
    gathered: list[dict] = [{} for _ in range(world)]
    for name, first in known.items():
        if first is None:  # the same on every rank: the model has no such field
            for part in gathered:
                part[name] = None
            continue
        shapes = [None if spec is None else spec[1][name][0] for spec in specs]
        widest = [max(s[d] for s in shapes if s is not None) for d in range(len(first[0]))]
        dtype = getattr(torch, first[1])
        mine = fields.get(name)
        if mine is None:
            mine = torch.zeros((0, *widest[1:]), dtype=dtype, device=device)
        wire = torch.zeros(widest, dtype=wire_dtype(dtype), device=device)
        wire[tuple(slice(0, size) for size in mine.shape)] = mine
        parts = [torch.empty_like(wire) for _ in range(world)]
        dist.all_gather(parts, wire)
        for rank, (part, shape) in enumerate(zip(parts, shapes)):
            if shape is not None:
                gathered[rank][name] = part[tuple(slice(0, size) for size in shape)].to(dtype)
    return [None if spec is None else _assemble(kind, part)
            for spec, part in zip(specs, gathered)]


@torch.no_grad()
def gather_rows(local: Any, wanted: Sequence[tuple[int, int]],
                device: torch.device | str | None = None) -> Any:
    """The rows ``wanted`` (``(rank, row)`` pairs, in that order) of the ranks' ``local``
    (as for :func:`gather_uneven`); each rank may want other rows. A collective, no gradient.

    Each rank's value is broadcast once and every rank keeps only its rows, so none
    holds more than those plus one rank's value in flight. Other dimensions are
    zero-padded to the widest among the source ranks (as ``cat_features`` pads tokens).
    """
    rank, world = world_info()
    specs, fields = _field_specs(local)
    kind, known = next(spec for spec in specs if spec is not None)
    present = [t for t in fields.values() if t is not None]
    device = present[0].device if present else torch.device(device or "cpu")
    sources = sorted({source for source, _ in wanted})
    positions = {source: [k for k, (s, _) in enumerate(wanted) if s == source]
                 for source in sources}
    rows = {source: torch.tensor([row for s, row in wanted if s == source], dtype=torch.long,
                                 device=device) for source in sources}
    out: dict[str, torch.Tensor | None] = {}
    for name, first in known.items():
        if first is None:  # the same on every rank: the model has no such field
            out[name] = None
            continue
        dtype = getattr(torch, first[1])
        shapes = [None if spec is None else spec[1][name][0] for spec in specs]
        used = [shapes[source] for source in sources] or [s for s in shapes if s is not None]
        widest = [max(s[d] for s in used) for d in range(1, len(first[0]))]
        result = torch.zeros((len(wanted), *widest), dtype=dtype, device=device)
        for source, shape in enumerate(shapes):
            if shape is None or shape[0] == 0:  # every rank knows: no broadcast from it
                continue
            part = (fields[name].to(wire_dtype(dtype)) if source == rank else
                    torch.empty(shape, dtype=wire_dtype(dtype), device=device))
            if world > 1:
                dist.broadcast(part, source)
            if source in rows:
                place = torch.tensor(positions[source], dtype=torch.long, device=device)
                result[(place, *(slice(0, size) for size in shape[1:]))] = \
                    part[rows[source]].to(dtype)
            del part
        out[name] = result
    return _assemble(kind, out)


def _tensor_fields(value: Any) -> dict[str, torch.Tensor | None]:
    if value is None:
        return {}
    if isinstance(value, torch.Tensor):
        return {"tensor": value}
    if not dataclasses.is_dataclass(value):
        raise TypeError(f"cannot gather {type(value).__name__}; give a tensor or a dataclass "
                        f"of tensors (ImageFeatures, TextFeatures)")
    return {field.name: getattr(value, field.name) for field in dataclasses.fields(value)}


def global_losses(outputs: dict[str, torch.Tensor], world: int, parts_are_means: bool = False,
                  statistics: bool = False) -> dict[str, torch.Tensor]:
    """A rank's part of each ``*_loss`` made the global loss: its value the sum of the
    ranks' parts (one all-reduce), its gradient ``world`` times the part's, so that the
    data-parallel average is the global loss's gradient.

    Args:
        parts_are_means: each part is a mean over an equal share (a constraint's
            ``reduction: mean``): the value is the parts' mean, the gradient the part's.
        statistics: also average the other scalar outputs over the ranks.
    """
    keys = [key for key, value in outputs.items() if key.endswith("_loss")
            or (statistics and value.numel() == 1)]
    if not keys:
        return outputs
    totals = torch.stack([outputs[key].detach().to(torch.float64).reshape(()) for key in keys])
    dist.all_reduce(totals)
    for key, total in zip(keys, totals):
        value = outputs[key]
        if key.endswith("_loss") and not parts_are_means:
            value = value * world
        else:
            total = total / world
        outputs[key] = value + (total.to(value.dtype) - value).detach()
    return outputs
