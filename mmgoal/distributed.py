"""Processes: the launcher's world, the process group, this rank, random states, and the
gathers across ranks; the one place that answers the world size (below the engine,
objectives and evaluation: docs/architecture.md). Everything works in one process too.

Why the differentiable gather (open_clip's) needs no loss rescaling, for global and
per-rank losses alike: docs/distributed.md, "Objectives on the global batch".
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import hashlib
import math
import os
import random
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as functional_collectives


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


def leave_process_group(wait: bool = True) -> None:
    """Leave the process group, if joined (``wait``: after every rank gets here). A
    garbage collection first: a collective's work object caught in a reference cycle (a
    ``TorchDispatchMode``'s, say) would outlive its group and abort the interpreter's
    teardown ("terminate called without an active exception")."""
    if not dist.is_initialized():
        return
    if wait:
        dist.barrier()
    gc.collect()
    dist.destroy_process_group()


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


def all_objects(value: Any) -> list[Any]:
    """Every rank's picklable ``value``, in rank order, on every rank (one collective)."""
    world = world_info()[1]
    if world == 1:
        return [value]
    values: list[Any] = [None] * world
    dist.all_gather_object(values, value)
    return values


def wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor of ``dtype`` travels as in a collective: bool as uint8 (gloo
    cannot send bool)."""
    return torch.uint8 if dtype == torch.bool else dtype


def _tensor_fields(value: Any) -> dict[str, torch.Tensor | None]:
    if value is None:
        return {}
    if isinstance(value, torch.Tensor):
        return {"tensor": value}
    if not dataclasses.is_dataclass(value):
        raise TypeError(f"cannot gather {type(value).__name__}; give a tensor or a dataclass "
                        f"of tensors (ImageFeatures, TextFeatures)")
    return {field.name: getattr(value, field.name) for field in dataclasses.fields(value)}


def _spec(value: Any) -> tuple | None:
    """``(type, {field: (shape, dtype name) or None})`` of a tensor or feature dataclass."""
    if value is None:
        return None
    return type(value), {name: None if t is None else
                         (tuple(t.shape), str(t.dtype).removeprefix("torch."))
                         for name, t in _tensor_fields(value).items()}


def _exchange(local: Any) -> list:
    """The shape exchange: every rank's :func:`_spec` of ``local`` (``None`` for a rank
    without one)."""
    return all_objects(_spec(local))


def _assemble(kind: type, fields: dict[str, torch.Tensor | None]) -> Any:
    """A gathered value of the type the ranks hold: a tensor, or the dataclass of ``fields``."""
    return fields["tensor"] if issubclass(kind, torch.Tensor) else kind(**fields)


def _padded_gather(mine: torch.Tensor | None, shapes: Sequence[tuple | None],
                   dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """The one padded gather: each rank's tensor (``None``: no rows) zero-padded to the
    widest in every dimension and all-gathered as ``(world * widest[0], *widest[1:])``, in
    rank order; differentiable (its backward a reduce-scatter: each rank receives the
    sum over ranks of its slice's gradient, half the bytes of an all-reduce)."""
    present = [shape for shape in shapes if shape is not None]
    widest = [max(shape[d] for shape in present) for d in range(len(present[0]))]
    if mine is None:
        mine = torch.zeros((0, *widest[1:]), dtype=dtype, device=device)
    wire = mine.to(wire_dtype(dtype)).contiguous()
    pad = [size for d in reversed(range(wire.dim())) for size in (0, widest[d] - wire.shape[d])]
    if any(pad):
        wire = torch.nn.functional.pad(wire, pad)
    out = functional_collectives.all_gather_single_autograd(wire, 0, dist.group.WORLD)
    return functional_collectives.wait_tensor(out).to(dtype), widest


def gather(local: Any, uneven: bool = False) -> Any:
    """A tensor or feature dataclass of every rank, rows concatenated in rank order, on
    every rank; differentiable (open_clip's ``gather_with_grad``; docs/distributed.md).

    Token fields (``(B, L, ...)``, a ``(B, L)`` bool mask) are zero-padded along ``L`` to
    the longest rank after one shape exchange; ``uneven``: the ranks' row counts differ
    too (statistics of varying length). Otherwise every rank's shapes must be the same
    (:func:`check_equal_shapes` checks it), and a field is one collective.
    """
    world = world_info()[1]
    if world == 1:
        return local
    fields = _tensor_fields(local)
    if uneven or any(t is not None and _token_like(t) for t in fields.values()):
        specs = _exchange(local)
        shapes = {name: [spec[1][name][0] for spec in specs]
                  for name, t in fields.items() if t is not None}
    else:
        shapes = {name: [tuple(t.shape)] * world for name, t in fields.items() if t is not None}
    out: dict[str, torch.Tensor | None] = {}
    for name, mine in fields.items():
        if mine is None:
            out[name] = None
            continue
        rows = [shape[0] for shape in shapes[name]]
        if not uneven and len(set(rows)) > 1:  # a rank's own rows would be misplaced
            raise RuntimeError(f"gather needs the same number of rows on every rank, got "
                               f"{rows} ({name}); drop partial batches")
        stacked, widest = _padded_gather(mine, shapes[name], mine.dtype, mine.device)
        parts = stacked.unflatten(0, (world, widest[0]))
        out[name] = (parts.flatten(0, 1) if len(set(rows)) == 1 else
                     torch.cat([part[:count] for part, count in zip(parts, rows)]))
    return _assemble(type(local), out)


def _token_like(value: torch.Tensor) -> bool:
    """Tokens (B, L, ...) or a (B, L) bool mask: padded along L to the longest rank."""
    return value.dim() >= 3 or (value.dim() == 2 and value.dtype == torch.bool)


@torch.no_grad()
def gather_each(local: Any, device: torch.device | str | None = None) -> list[Any]:
    """Every rank's ``local`` apart, in rank order, on every rank; no gradient (evaluation's).

    ``local``: a tensor or feature dataclass whose shapes may differ across ranks in
    every dimension, or ``None`` on a rank with an empty share (``device`` then places
    its part of the collective: the GPU under NCCL).
    """
    world = world_info()[1]
    if world == 1:
        return [local]
    specs, fields = _exchange(local), _tensor_fields(local)
    kind, known = next(spec for spec in specs if spec is not None)
    device = _device_of(fields, device)
    gathered: list[dict] = [{} for _ in range(world)]
    for name, first in known.items():
        if first is None:  # alike on every rank: the model has no such field
            for part in gathered:
                part[name] = None
            continue
        shapes = [None if spec is None else spec[1][name][0] for spec in specs]
        stacked, widest = _padded_gather(fields.get(name), shapes, getattr(torch, first[1]),
                                         device)
        parts = stacked.unflatten(0, (world, widest[0]))
        for rank, shape in enumerate(shapes):
            if shape is not None:
                gathered[rank][name] = parts[rank][tuple(slice(0, size) for size in shape)]
    return [None if spec is None else _assemble(kind, part)
            for spec, part in zip(specs, gathered)]


def _device_of(fields: dict[str, torch.Tensor | None],
               device: torch.device | str | None) -> torch.device:
    present = [t for t in fields.values() if t is not None]
    return present[0].device if present else torch.device(device or "cpu")


def check_equal_shapes(*tensors: torch.Tensor) -> None:
    """Raise a ``RuntimeError`` unless every rank holds ``tensors`` of the same shapes
    (one shape exchange), before a gather of different shapes aborts the group."""
    if world_info()[1] == 1:
        return
    shapes = all_objects([tuple(t.shape) for t in tensors])
    if any(rank_shapes != shapes[0] for rank_shapes in shapes):
        raise RuntimeError(f"every rank must gather tensors of the same shapes, got "
                           f"{shapes} (rank by rank); drop partial batches")


def sum_over_ranks(local: torch.Tensor) -> torch.Tensor:
    """``local`` summed over every rank, on every rank (a new tensor; no gradient)."""
    total = local.detach().clone()
    if world_info()[1] > 1:
        dist.all_reduce(total)
    return total


def id_hashes(image_ids: Sequence, device: torch.device | str = "cpu") -> torch.Tensor:
    """(B,) int64 stable hashes of image ids: equal ids, equal numbers, on every rank."""
    return torch.tensor([int.from_bytes(hashlib.blake2b(str(i).encode(), digest_size=8).digest(),
                                        "little", signed=True) for i in image_ids],
                        dtype=torch.long, device=device)


def gather_groups(image_ids: Sequence, device: torch.device | str = "cpu") -> torch.Tensor:
    """(world * B,) group numbers of the global batch on ``device`` (NCCL gathers on the
    GPU): positives are equal image ids."""
    return gather(id_hashes(image_ids, device))


def rank_share(count: int, rank: int, world: int, unit: int = 1) -> tuple[int, int]:
    """``(start, end)``: rank ``rank``'s contiguous share of ``count`` items dealt out in
    whole units of ``unit`` items (batches, blocks), so that each unit is the one a single
    process would form and computes bit for bit the same."""
    units = math.ceil(count / unit)
    return (min(rank * units // world * unit, count),
            min((rank + 1) * units // world * unit, count))


@torch.no_grad()
def gather_rows(local: Any, wanted: Sequence[tuple[int, int]],
                device: torch.device | str | None = None) -> Any:
    """The rows ``wanted`` (``(rank, row)`` pairs, in that order) of the ranks' ``local``
    (as for :func:`gather_each`); each rank may want other rows. A collective, no gradient.

    Each rank's value is broadcast once and every rank keeps only its rows, so none
    holds more than those plus one rank's value in flight. Other dimensions are
    zero-padded to the widest among the source ranks (as ``cat_features`` pads tokens).
    """
    rank, world = world_info()
    specs, fields = _exchange(local), _tensor_fields(local)
    kind, known = next(spec for spec in specs if spec is not None)
    device = _device_of(fields, device)
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
