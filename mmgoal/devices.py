"""Where tensors live and in what precision: device choice, batch transfer, autocast.
Inputs move to the model's device (:func:`module_device`), so one config runs unchanged
on a CPU, one GPU or many (docs/getting_started.md, "Training on GPUs").
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from mmgoal.config import MatmulPrecision, Precision, check_value

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def cuda_summary() -> str:
    """What this machine offers, for error messages: devices found and torch's CUDA build."""
    build = torch.version.cuda or "none (a CPU-only build)"
    if not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__}, CUDA build {build})"
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return f"{len(names)} CUDA device(s): {', '.join(names)} (torch {torch.__version__})"


def resolve_device(spec: str = "auto", local_rank: int | None = None,
                   name: str = "train.device") -> torch.device:
    """The device ``spec`` names: ``auto`` (``cuda:<local rank>`` where CUDA is, else
    ``cpu``), ``cpu``, ``cuda`` (``cuda:<local rank>``) or ``cuda:N``; ``name`` is how
    messages call it. ``ValueError`` for an unknown spec or CUDA where there is none."""
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    spec = str(spec).strip().lower()
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cpu":
        return torch.device("cpu")
    kind, _, index = spec.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise ValueError(f"{name} must be auto, cpu, cuda or cuda:N, got {spec!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"{name} {spec!r} asks for a GPU, but this machine has "
                         f"{cuda_summary()}; use {name} auto (the GPU where there is one, "
                         f"else the CPU) or cpu")
    number = int(index) if index else local_rank
    if number >= torch.cuda.device_count():
        raise ValueError(f"{name} {spec!r}: this process would use cuda:{number}, but "
                         f"this machine has {cuda_summary()}")
    return torch.device("cuda", number)


def precision_dtype(precision: Precision) -> torch.dtype:
    """``fp32`` / ``bf16`` / ``fp16`` -> the torch dtype (``ValueError`` for another)."""
    check_value("precision", precision, Precision)
    return _DTYPES[precision]


def check_precision(precision: Precision, device: torch.device) -> None:
    """Refuse a precision the device cannot train in, with what to use instead."""
    precision_dtype(precision)
    if precision == "fp16" and device.type == "cpu":
        raise ValueError("train.precision fp16 trains on GPUs only (float16 with loss "
                         "scaling); on the CPU use bf16 or fp32")
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(f"train.precision bf16: {torch.cuda.get_device_name(device)} has no "
                         f"bfloat16 support; use fp16 (with loss scaling) or fp32")


def autocast(device: torch.device, precision: Precision) -> contextlib.AbstractContextManager:
    """``torch.autocast`` for bf16/fp16 on ``device``; nothing for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=precision_dtype(precision))


def move_to_device(value, device: torch.device, non_blocking: bool = False):
    """``value`` with every tensor in its mappings, lists, tuples and dataclasses moved to
    ``device`` (``non_blocking``: overlapped with compute from pinned memory)."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=non_blocking)
    if isinstance(value, Mapping):
        return {k: move_to_device(v, device, non_blocking) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        moved = [move_to_device(v, device, non_blocking) for v in value]
        return type(value)(*moved) if hasattr(value, "_fields") else type(value)(moved)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{
            f.name: move_to_device(getattr(value, f.name), device, non_blocking)
            for f in dataclasses.fields(value) if f.init})
    return value


def module_device(module: torch.nn.Module) -> torch.device:
    """The device of a module's first parameter (or buffer); the CPU for an empty module."""
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    return torch.device("cpu")


def free_memory_mb(device: torch.device) -> float | None:
    """Free memory of a CUDA device in MiB (what the allocator could still get); None on CPU."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free / 2**20 + (torch.cuda.memory_reserved(device)
                           - torch.cuda.memory_allocated(device)) / 2**20


CPU_CACHES = "/sys/devices/system/cpu/cpu0/cache"  # Linux: one index<N>/ folder per cache


def _cpu_count(cpu_list: str) -> int:
    """How many CPUs a sysfs list names (``0-3,8,10-11``: 7)."""
    count = 0
    for part in cpu_list.strip().split(","):
        first, _, last = part.partition("-")
        count += int(last or first) - int(first) + 1
    return count


def cache_share_mb(threads: int | None = None, caches: str = CPU_CACHES) -> float | None:
    """This process's share of the CPU's last-level cache in MiB: the largest level's size
    over the CPUs that share it, times the process's torch threads (at most those CPUs);
    None where the system does not say (no Linux sysfs)."""
    threads = threads or torch.get_num_threads()
    levels = []
    for index in sorted(Path(caches).glob("index*")):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            size = (index / "size").read_text().strip().upper()
            scale = {"K": 2**-10, "M": 1.0, "G": 2**10}.get(size[-1:], 2**-20)
            sharing = _cpu_count((index / "shared_cpu_list").read_text())
            levels.append((int((index / "level").read_text()),
                           float(size.rstrip("KMG")) * scale, sharing))
        except (OSError, ValueError):
            continue
    if not levels:
        return None
    _, size_mb, sharing = max(levels)
    return size_mb / max(sharing, 1) * min(threads, max(sharing, 1))


def configure_cuda(device: torch.device, matmul_precision: MatmulPrecision,
                   cudnn_benchmark: bool) -> None:
    """Per-process GPU settings: the current device, TF32 matmuls (``matmul_precision``
    ``high``; ``highest`` keeps them exact), cuDNN autotuning. Nothing on the CPU."""
    if device.type != "cuda":
        return
    torch.cuda.set_device(device)
    torch.set_float32_matmul_precision(matmul_precision)
    torch.backends.cudnn.allow_tf32 = matmul_precision != "highest"
    # Training batches have one image size, so the fastest convolution found once stays so.
    torch.backends.cudnn.benchmark = cudnn_benchmark


_workspace: dict[str, torch.Tensor] | None = None


@contextlib.contextmanager
def reuse_buffers():
    """Within the block, scoring without autograd reuses its large work arrays
    (:func:`work_buffer`) from one call to the next instead of allocating (and
    page-faulting) them every block; they are freed on exit. Evaluation scores a gallery
    inside it."""
    global _workspace
    previous, _workspace = _workspace, {}
    try:
        yield
    finally:
        _workspace = previous


def work_buffer(name: str, shape: tuple[int, ...], like: torch.Tensor,
                enabled: bool) -> torch.Tensor | None:
    """A work array of ``shape`` from the workspace, or ``None`` (allocate) outside one or
    where not ``enabled`` (autograd keeps its tensors for the backward pass)."""
    if _workspace is None or not enabled:
        return None
    numel = math.prod(shape)
    buffer = _workspace.get(name)
    if buffer is None or buffer.numel() < numel or buffer.dtype != like.dtype \
            or buffer.device != like.device:
        buffer = _workspace[name] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buffer[:numel].view(shape)
