"""SigLIPLoss (mmgoal/objectives/siglip.py): open_clip's SigLipLoss on the same features,
its scale and bias learnt or the model's, several positives per image, any block size."""

import math

import pytest
import torch
import torch.nn.functional as F

from mmgoal.registry import OBJECTIVES
from mmgoal.structures import ObjectiveInputs


def features(n: int, dim: int = 8, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    image = F.normalize(torch.randn(n, dim, generator=generator, dtype=torch.float64), dim=-1)
    text = F.normalize(torch.randn(n, dim, generator=generator, dtype=torch.float64), dim=-1)
    return image.requires_grad_(), text.requires_grad_()


def test_siglip_equals_open_clips_loss_and_gradients():
    open_clip_loss = pytest.importorskip("open_clip.loss")
    image, text = features(12)
    loss_fn = OBJECTIVES.build({"type": "SigLIPLoss"}).double()
    ours = loss_fn(ObjectiveInputs(image @ text.T))
    ours["siglip_loss"].backward()
    mine = [image.grad.clone(), text.grad.clone(), loss_fn.logit_scale.grad.clone(),
            loss_fn.logit_bias.grad.clone()]
    image.grad = text.grad = None
    # the same t' (log 10 as the loss holds it) and b, as leaves of open_clip's loss
    scale = loss_fn.logit_scale.detach().clone().requires_grad_()
    bias = loss_fn.logit_bias.detach().clone().requires_grad_()
    assert scale.item() == pytest.approx(math.log(10.0)) and bias.item() == -10.0
    theirs = open_clip_loss.SigLipLoss()(image, text, scale.exp(), bias)
    theirs.backward()
    torch.testing.assert_close(ours["siglip_loss"], theirs, atol=1e-12, rtol=0)
    for got, expected in zip(mine, [image.grad, text.grad, scale.grad, bias.grad]):
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)
    assert ours["logit_scale"] == pytest.approx(10.0) and ours["logit_bias"] == -10.0


def test_several_positives_per_image_are_positive_pairs():
    image, text = features(6, seed=1)
    scores = (image @ text.T).detach().requires_grad_()
    positives = torch.eye(6, dtype=torch.bool)
    positives[0, 1] = positives[3, 4] = True
    loss_fn = OBJECTIVES.build({"type": "SigLIPLoss"}).double()
    loss_fn(ObjectiveInputs(scores, positives))["siglip_loss"].backward()
    # the autograd reference of the formula, element by element
    reference = scores.detach().clone().requires_grad_()
    signs = positives.double() * 2 - 1
    logits = loss_fn.logit_scale.detach().exp() * reference - 10.0
    (-F.logsigmoid(signs * logits).sum() / 6).backward()
    torch.testing.assert_close(scores.grad, reference.grad, atol=1e-12, rtol=0)


class ScaledModel(torch.nn.Module):
    """A model with CLIP's logit_scale and, optionally, SigLIP's logit_bias."""

    def __init__(self, bias: float | None) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(math.log(20.0)))
        self.bias = None if bias is None else torch.nn.Parameter(torch.tensor(bias))

    def encode_image(self, batch):
        raise NotImplementedError

    encode_text = similarity = encode_image

    def temperature(self):
        return torch.exp(-self.scale)

    def logit_bias(self):
        return self.bias


def test_a_models_own_scale_and_bias_are_used_and_trained():
    image, text = features(5, seed=2)
    for bias in (None, -3.0):
        model = ScaledModel(bias)
        loss_fn = OBJECTIVES.build({"type": "SigLIPLoss"}, model=model)
        # the model's scale, and its bias where it has one: the loss's own are buffers then
        assert "logit_scale" not in dict(loss_fn.named_parameters())
        assert ("logit_bias" in dict(loss_fn.named_parameters())) == (bias is None)
        out = loss_fn(ObjectiveInputs((image @ text.T).float(), model=model))
        out["siglip_loss"].backward()
        assert out["logit_scale"] == pytest.approx(20.0)
        assert out["logit_bias"] == pytest.approx(-10.0 if bias is None else -3.0)
        assert model.scale.grad is not None and model.scale.grad != 0
        assert bias is None or model.bias.grad != 0


@pytest.mark.slow
def test_the_tiny_siglip_config_trains_its_bias_and_the_models_scale(tiny_benchmark, tmp_path):
    import json
    from pathlib import Path

    pytest.importorskip("open_clip")
    from mmgoal.engine.trainer import Trainer
    from mmgoal.runs.checkpoint import load_checkpoint
    from mmgoal.runs.schema import load_run_config

    out, _ = tiny_benchmark
    root = Path(__file__).resolve().parents[2]
    cfg = load_run_config(root / "configs" / "clip" / "clip_tiny_synthetic_siglip.yaml", [
        "data.num_workers=0", "data.train.batch_size=16", "train.samples_per_epoch=48",
        "train.epochs=1", "train.progress=false", "train.log_every=1",
        "model.model_kwargs.vision_cfg.layers=1", "model.model_kwargs.text_cfg.layers=1",
        f"data.train.shards={out}/train-{{000000..000002}}.tar",
        f"data.val.shards={out}/val-000000.tar", f"data.test.shards={out}/test-000000.tar"])
    torch.manual_seed(0)
    trainer = Trainer(cfg, tmp_path / "run")
    scale = trainer.model.model.logit_scale.item()
    report = trainer.fit()
    records = [json.loads(line) for line in
               (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["type"] == "train"]
    assert len(train) == 3 and all(math.isfinite(r["siglip_loss"]) for r in train)
    assert train[0]["logit_bias"] == pytest.approx(-10.0)  # the paper's initial bias
    assert train[-1]["logit_bias"] != train[0]["logit_bias"]  # the loss's own bias learns
    assert train[0]["logit_scale"] == pytest.approx(math.exp(scale), rel=1e-5)  # the model's
    state = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")
    assert state["model"]["model.logit_scale"].item() != scale  # and it trains it
    assert "test" in report and math.isfinite(report["test"]["rsum"])
