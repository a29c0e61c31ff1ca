"""Running a test's function on several CPU processes (gloo), as ranks of one job."""

import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mmgoal.distributed import leave_process_group


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank(rank: int, world: int, port: int, out_dir: str, body, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.save(body(rank, world, *args), os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # every rank's result is written
    finally:
        leave_process_group(wait=False)
    # A rank whose result is written leaves at once: DeepSpeed's CPU shared-memory
    # all-reduce (deepspeed_shm_comm) can abort a process in the interpreter's teardown
    # ("terminate called without an active exception"), after its work is done
    os._exit(0)


def run_ranks(body, out_dir, *args, world: int = 2) -> list:
    """``body(rank, world, *args)`` in ``world`` spawned processes joined in a gloo group;
    what each returns (tensors, lists, dicts of them), in rank order. ``body`` must be a
    module-level function (the processes import it)."""
    mp.spawn(_rank, args=(world, free_port(), str(out_dir), body, args), nprocs=world,
             join=True)
    return [torch.load(Path(out_dir) / f"rank{rank}.pt", weights_only=True)
            for rank in range(world)]
