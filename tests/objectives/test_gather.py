"""A GOAL objective on features gathered over 2 processes (gloo, CPU) matches one process."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from mmgoal.objectives.gather import gather_features, gather_with_grad
from mmgoal.objectives.mining import positives_from_groups
from mmgoal.registry import OBJECTIVES

BATCH, DIM = 12, 5
GROUPS = torch.tensor([0, 1, 1, 2, 3, 4, 4, 5, 6, 7, 8, 8])  # duplicates across the rank split


def make_problem():
    torch.manual_seed(0)
    image_encoder = torch.nn.Linear(DIM, 4, dtype=torch.float64)
    text_encoder = torch.nn.Linear(DIM, 4, dtype=torch.float64)
    images = torch.randn(BATCH, DIM, dtype=torch.float64)
    texts = torch.randn(BATCH, DIM, dtype=torch.float64)
    return image_encoder, text_encoder, images, texts


def objective():
    return OBJECTIVES.build({"type": "GoalObjective", "triplet": "cir", "pair": "sig_ms"})


def step(image_encoder, text_encoder, images, texts, groups):
    """One SGD step; the loss sees the features of every rank."""
    img = gather_with_grad(F.normalize(image_encoder(images), dim=-1))
    txt = gather_with_grad(F.normalize(text_encoder(texts), dim=-1))
    all_groups = gather_with_grad(groups)
    loss = objective()(img @ txt.T, positives_from_groups(all_groups))["goal_loss"]
    loss.backward()
    params = [*image_encoder.parameters(), *text_encoder.parameters()]
    for p in params:
        if dist.is_initialized():  # what DDP does: average the ranks' gradients
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        p.data -= 0.1 * p.grad
    return [p.detach().clone() for p in params]


def worker(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        image_encoder, text_encoder, images, texts = make_problem()
        local = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        params = step(image_encoder, text_encoder, images[local], texts[local], GROUPS[local])
        torch.save(params, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multiprocess
def test_two_process_gathered_update_matches_one_process(tmp_path):
    single = step(*make_problem(), GROUPS)
    mp.spawn(worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        gathered = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for a, b in zip(single, gathered):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_gather_is_the_identity_in_one_process():
    x = torch.randn(3, 2, requires_grad=True)
    assert gather_with_grad(x) is x and gather_features(x) is x
