"""Gradient caching (docs/distributed.md, "Gradient caching"): a batch encoded in chunks
without a graph, the losses' feature gradients cached, each chunk encoded again and
back-propagated, gives the gradients of one backward through the whole batch."""

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from ranks import run_ranks  # tests/ranks.py

from mmgoal.distributed import id_hashes
from mmgoal.engine.step import TrainingStep
from mmgoal.registry import OBJECTIVES
from mmgoal.structures import ImageFeatures, TextFeatures

DIM = 6
OBJECTIVE = {"type": "ObjectiveSum", "terms": [
    {"type": "InfoNCELoss"},  # the model's learnable temperature: read by the loss directly
    {"type": "GoalObjective", "triplet": "cir", "pair": {"type": "sig_ms", "eps": 0.5}}]}


class Towers(torch.nn.Module):
    """Two towers with dropout and token features, scored by the cosine of their pooled
    embeddings, with a CLIP-like learnable temperature."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.image = torch.nn.Sequential(torch.nn.Linear(DIM, 2 * DIM), torch.nn.Dropout(dropout),
                                         torch.nn.Linear(2 * DIM, 2 * DIM))
        self.text = torch.nn.Sequential(torch.nn.Linear(DIM, 2 * DIM), torch.nn.Dropout(dropout),
                                        torch.nn.Linear(2 * DIM, 2 * DIM))
        # (1,), not 0-dim: DeepSpeed's broadcast of the initial weights views each as bytes
        self.logit_scale = torch.nn.Parameter(torch.tensor([2.0]))
        self.double()

    def _features(self, kind, tower, inputs):
        tokens = tower(inputs).reshape(len(inputs), 2, DIM)
        return kind(F.normalize(tokens.mean(1), dim=-1), tokens=tokens,
                    mask=torch.ones(len(inputs), 2, dtype=torch.bool))

    def encode_image(self, batch):
        return self._features(ImageFeatures, self.image, batch["image_inputs"])

    def encode_text(self, batch):
        return self._features(TextFeatures, self.text, batch["text_inputs"])

    def similarity(self, images, texts):
        return images.embedding @ texts.embedding.T

    def temperature(self):
        return 1 / self.logit_scale[0].exp()


def make_batch(n: int, seed: int = 1, dtype: torch.dtype = torch.float64) -> dict:
    generator = torch.Generator().manual_seed(seed)
    ids = list(range(n))
    ids[2] = ids[1]  # two captions of one image
    return {"image_inputs": torch.randn(n, DIM, generator=generator, dtype=dtype),
            "text_inputs": torch.randn(n, DIM, generator=generator, dtype=dtype),
            "image_ids": ids, "image_groups": id_hashes(ids), "skipped": 0}


def make_step(dropout: float, chunk: int | None, objective: dict = OBJECTIVE,
              dtype: torch.dtype = torch.float64) -> TrainingStep:
    model = Towers(dropout).to(dtype)
    return TrainingStep(model, OBJECTIVES.build(objective, model=model).to(dtype),
                        grad_cache_chunk=chunk)


def gradients(step: TrainingStep) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in step.named_parameters() if p.grad is not None}


def cached_step(step: TrainingStep, batch: dict) -> tuple[dict, dict]:
    """What the torch strategy does with one micro-batch (one process)."""
    outputs, cache = step.cache_gradients(batch)
    for index in range(len(cache.chunks)):
        step(batch, replay=(cache, index))["loss"].backward()
    return outputs, gradients(step)


def chunked_reference(step: TrainingStep, batch: dict, chunk: int) -> tuple[dict, dict]:
    """The same chunks encoded with their graphs kept, in the same order (so the same
    dropout draws), and one backward through the whole batch: autograd's gradient."""
    from mmgoal.engine.step import slice_batch
    from mmgoal.structures import cat_features

    n = len(batch["image_groups"])
    images, texts = [], []
    for start in range(0, n, chunk):
        image, text = step.encode(slice_batch(batch, start, min(start + chunk, n), n))
        images.append(image)
        texts.append(text)
    outputs = step.losses(batch, cat_features(images), cat_features(texts))
    outputs["loss"].backward()
    return outputs, gradients(step)


def assert_same(got: dict, expected: dict, atol: float = 1e-10, rtol: float = 0.0) -> None:
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, atol=atol, rtol=rtol,
                                   msg=lambda text, key=key: f"{key}: {text}")


@pytest.mark.parametrize("n,chunk", [(8, 3), (8, 8), (6, 1)])
def test_cached_gradients_equal_one_backward_through_the_batch(n, chunk):
    batch = make_batch(n)
    plain = make_step(0.0, None)
    plain_outputs = plain(batch)
    plain_outputs["loss"].backward()
    outputs, grads = cached_step(make_step(0.0, chunk), batch)
    assert_same(grads, gradients(plain))
    assert "model.logit_scale" in grads and grads["model.logit_scale"].abs() > 0
    assert_same(outputs, {key: value.detach() for key, value in plain_outputs.items()})


def test_with_dropout_each_chunk_replays_its_own_draws():
    batch = make_batch(8)
    steps = [make_step(0.3, 3), make_step(0.3, None), make_step(0.3, None)]  # seeds torch
    torch.manual_seed(5)
    outputs, grads = cached_step(steps[0], batch)
    after_cached = torch.rand(3)
    torch.manual_seed(5)
    reference_outputs, reference = chunked_reference(steps[1], batch, 3)
    after_reference = torch.rand(3)
    assert_same(grads, reference)
    torch.testing.assert_close(outputs["loss"], reference_outputs["loss"].detach())
    # the replays drew nothing: the random stream goes on where the reference's does
    assert torch.equal(after_cached, after_reference)
    # and the draws mattered: without replaying them, the gradients differ
    torch.manual_seed(6)
    _, other = chunked_reference(steps[2], batch, 3)
    assert (other["model.image.0.weight"] - reference["model.image.0.weight"]).abs().max() > 1e-3


def test_batch_norm_in_training_mode_is_refused():
    step = make_step(0.0, 4)
    step.model.image.append(torch.nn.BatchNorm1d(2 * DIM).double())
    with pytest.raises(ValueError, match=r"train.grad_cache_chunk: the model has BatchNorm "
                                         r"layers in training mode \(image.3\)"):
        step.cache_gradients(make_batch(8))
    step.model.image[3].eval()  # frozen statistics: each chunk is normalised alike
    cached_step(step, make_batch(8))


def ddp_ranks(rank, world):
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    return [ddp_rank(rank, world, chunk, scoring, strategy)
            for chunk, scoring, strategy in ((3, "local", "torch"), (2, "replicated", "torch"),
                                             (3, "local", "accelerate"))]


def ddp_rank(rank, world, chunk, scoring, kind):
    """One optimisation step of the torch strategy (DDP over gloo) or the accelerate one,
    SGD with lr 1, so the weights move by minus the all-reduced gradient."""
    from mmgoal.engine.strategies.torch_native import TorchStrategy

    if kind == "accelerate":
        from mmgoal.engine.strategies.accelerate import AccelerateStrategy

        strategy = AccelerateStrategy(device="cpu")
    else:
        strategy = TorchStrategy(device="cpu", find_unused_parameters=False)
    step = make_step(0.0, chunk)
    step.scoring = scoring
    strategy.setup(step, {"type": "SGD", "lr": 1.0}, 4, 1, None)
    before = {name: p.detach().clone() for name, p in step.named_parameters()}
    batch = make_batch(4 * world)
    mine = slice(rank * 4, (rank + 1) * 4)
    rank_batch = {key: value[mine] if key != "skipped" else value for key, value in batch.items()}
    result = strategy.train_step([rank_batch])
    return {"moved": {name: before[name] - p.detach() for name, p in step.named_parameters()},
            "loss": result.outputs["loss"], "applied": result.applied}


@pytest.mark.multiprocess
def test_ddp_with_local_scoring_gives_the_one_process_step(tmp_path):
    pytest.importorskip("accelerate")
    world = 2
    one = make_step(0.0, None)
    outputs = one(make_batch(4 * world))
    outputs["loss"].backward()
    expected = gradients(one)
    for results in zip(*run_ranks(ddp_ranks, tmp_path, world=world)):
        # torch: local scoring in chunks of 3, replicated in chunks of 2; accelerate: local
        for result in results:
            assert result["applied"]
            torch.testing.assert_close(result["loss"], outputs["loss"].detach().float())
            assert_same({k: v for k, v in result["moved"].items() if k in expected}, expected,
                        atol=1e-9)


GOAL_ONLY = OBJECTIVE["terms"][1]


def deepspeed_rank(rank, world, stage):
    """One SGD step (lr 1) of the DeepSpeed strategy on this rank's 4 pairs, encoded 3 at a
    time: the full weights' move is minus the global batch's gradient."""
    from mmgoal.engine.strategies.deepspeed import DeepSpeedStrategy

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    strategy = DeepSpeedStrategy(zero_stage=stage, device="cpu")
    step = make_step(0.0, 3, GOAL_ONLY, torch.float32)
    before = {name: p.detach().clone() for name, p in step.model.named_parameters()}
    strategy.setup(step, {"type": "SGD", "lr": 1.0}, 4, 1, None)
    batch = make_batch(4 * world, dtype=torch.float32)
    mine = slice(rank * 4, (rank + 1) * 4)
    result = strategy.train_step([{key: value[mine] if key != "skipped" else value
                                   for key, value in batch.items()}])
    weights = strategy.full_state_dict()
    return {"applied": result.applied, "loss": result.outputs["loss"],
            "moved": None if weights is None else {
                f"model.{name}": before[name] - weights[name] for name in before}}


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_gives_the_one_process_step(tmp_path, monkeypatch, stage):
    pytest.importorskip("deepspeed")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    # DeepSpeed's CPU communication extension, built once where the distributed tests build it
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", os.environ.get(
        "TORCH_EXTENSIONS_DIR", str(Path(sys.executable).parent.parent / "torch_extensions")))
    world = 2
    one = make_step(0.0, None, GOAL_ONLY, torch.float32)
    outputs = one(make_batch(4 * world, dtype=torch.float32))
    outputs["loss"].backward()
    results = run_ranks(deepspeed_rank, tmp_path, stage, world=world)
    assert all(result["applied"] for result in results)
    torch.testing.assert_close(results[0]["loss"], outputs["loss"].detach())
    expected = gradients(one)
    assert_same({k: v for k, v in results[0]["moved"].items() if k in expected}, expected,
                atol=1e-5, rtol=1e-5)
