"""What the 2-rank benchmarks (bench/itm.py, bench/gather.py, bench/eval_ranks.py) share: a
free port, the rank processes started with one thread each and rank 0's result handed back,
and a rank's process group."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mmgoal.distributed import leave_process_group


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(worker: Callable, args: Any, world: int) -> Any:
    """``worker(rank, port, args, queue)`` in ``world`` spawned processes (gloo on
    127.0.0.1, ``OMP_NUM_THREADS=1`` each); what rank 0 put in the queue."""
    os.environ["OMP_NUM_THREADS"] = "1"  # before the processes start: one thread each
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(worker, args=(free_port(), args, queue), nprocs=world, join=True,
                       start_method="spawn")
    return queue.get()


@contextlib.contextmanager
def joined(rank: int, port: int, world: int, backend: str = "gloo") -> Iterator[None]:
    """A worker's process group on 127.0.0.1 (one torch thread), destroyed on the way out."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        yield
    finally:
        leave_process_group()
