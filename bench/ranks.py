"""What the 2-rank benchmarks (bench/itm.py, bench/gather.py) share: a free port, and the
rank processes started with one thread each and rank 0's result handed back."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


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
