"""Two-stage training (VSE++), freezing schedules and per-module learning rates."""

import pytest
import torch
from test_trainer import tiny_config  # same folder: pytest puts it on sys.path

from mmgoal.engine.hooks import FreezeSchedule
from mmgoal.engine.optimizers import build_optimizer
from mmgoal.engine.trainer import Trainer
from mmgoal.registry import MODELS, OBJECTIVES
from mmgoal.runs.checkpoint import load_checkpoint


def backbone(state):
    return {k: v for k, v in state.items() if k.startswith("image_encoder.model.")}


@pytest.mark.slow
def test_stage_two_starts_from_stage_one_with_the_backbone_trainable(tiny_benchmark, tmp_path):
    out, _ = tiny_benchmark
    stage_one = tiny_config(out, epochs=1)
    stage_one["hooks"] = [{"type": "FreezeSchedule", "frozen": ["image_encoder.model"]}]
    first = Trainer(stage_one, tmp_path / "one")
    initial = {k: v.clone() for k, v in first.model.state_dict().items()}
    first.fit()
    one = load_checkpoint(tmp_path / "one" / "checkpoints" / "last.pt")
    for name, tensor in backbone(one["model"]).items():  # weights and BN statistics
        assert torch.equal(tensor, initial[name]), name
    assert not torch.equal(one["model"]["image_proj.weight"], initial["image_proj.weight"])

    stage_two = tiny_config(out, epochs=1)
    stage_two["hooks"] = []
    stage_two["load_from"] = str(tmp_path / "one" / "checkpoints" / "last.pt")
    stage_two["optimizer"] = {"type": "AdamW", "lr": 1e-3, "weight_decay": 1e-4,
                              "paramwise": {"image_encoder.model": {"lr_mult": 0.1},
                                            "text_encoder": {"lr_mult": 0.5}}}
    second = Trainer(stage_two, tmp_path / "two")
    for name, tensor in one["model"].items():
        assert torch.equal(second.model.state_dict()[name], tensor), name
    assert second.tokenizer.words == one["tokenizer"]["words"]
    groups = {g["name"]: g for g in second.optimizer.param_groups}
    assert groups["image_encoder.model"]["lr"] == pytest.approx(1e-4)
    assert groups["text_encoder"]["lr"] == pytest.approx(5e-4)
    assert groups["base"]["lr"] == pytest.approx(1e-3)
    assert groups["base"]["weight_decay"] == pytest.approx(1e-4)
    second.fit()
    two = load_checkpoint(tmp_path / "two" / "checkpoints" / "last.pt")
    changed = [k for k, v in backbone(two["model"]).items() if not torch.equal(v, one["model"][k])]
    assert len(changed) == len(backbone(two["model"]))


def test_load_from_refuses_another_architecture(tiny_benchmark, tmp_path):
    out, _ = tiny_benchmark
    source = tiny_config(out, epochs=1)
    trainer = Trainer(source, tmp_path / "src")
    trainer.save_weights("start.pt")
    other = tiny_config(out, epochs=1)
    other["model"]["embed_dim"] = 8
    other["load_from"] = str(tmp_path / "src" / "checkpoints" / "start.pt")
    with pytest.raises(ValueError, match="does not match this config's model"):
        Trainer(other, tmp_path / "other")


class FakeTrainer:
    def __init__(self, model, epoch):
        self.model, self.epoch = model, epoch


def small_resnet():
    from mmgoal.data.tokenizers import WordTokenizer

    return MODELS.build({
        "type": "DualEncoder", "embed_dim": 8,
        "image_encoder": {"type": "TimmImageEncoder", "model_name": "resnet18"},
        "text_encoder": {"type": "GRUTextEncoder", "word_dim": 4, "hidden_size": 4},
    }, tokenizer=WordTokenizer(vocab=["a"]))


def test_freeze_schedule_unfreezes_block_by_block():
    model = small_resnet()
    hook = FreezeSchedule(frozen=["image_encoder.model"],
                          unfreeze={1: ["image_encoder.model.layer4"],
                                    2: ["image_encoder.model.layer3"]})
    trainable = {}
    for epoch in range(3):
        model.train()
        hook.before_epoch(FakeTrainer(model, epoch))
        trainable[epoch] = {n.split(".")[2] for n, p in model.named_parameters()
                            if n.startswith("image_encoder.model.") and p.requires_grad}
        bn = model.image_encoder.model.layer4[0].bn1
        assert bn.training == (epoch >= 1)
    assert trainable == {0: set(), 1: {"layer4"}, 2: {"layer3", "layer4"}}
    assert model.image_proj.weight.requires_grad
    hook.before_epoch(FakeTrainer(model, 0))  # a resumed run at epoch 0 freezes again
    assert not model.image_encoder.model.layer4[0].conv1.weight.requires_grad
    with pytest.raises(ValueError, match="no module 'image_encoder.modle'"):
        FreezeSchedule(frozen=["image_encoder.modle"]).before_epoch(FakeTrainer(model, 0))


def test_paramwise_groups_and_their_errors():
    model = small_resnet()
    objective = OBJECTIVES.build({"type": "InfoNCELoss"})
    optimizer = build_optimizer({"type": "AdamW", "lr": 1.0, "paramwise": {
        "image_encoder": {"lr_mult": 0.1}, "image_encoder.model.layer4": {"lr_mult": 0.01}}},
        model, objective)
    groups = {g["name"]: g for g in optimizer.param_groups}
    assert {n: g["lr"] for n, g in groups.items()} == pytest.approx(
        {"base": 1.0, "image_encoder": 0.1, "image_encoder.model.layer4": 0.01, "objective": 1.0})
    assert groups["base"]["weight_decay"] == 0.01  # AdamW's own default
    owned = {id(p) for p in groups["image_encoder.model.layer4"]["params"]}
    assert owned == {id(p) for p in model.image_encoder.model.layer4.parameters()}
    assert sum(len(g["params"]) for g in optimizer.param_groups) == \
        len(list(model.parameters())) + 1
    with pytest.raises(ValueError, match="no module 'img_encoder'; top-level modules"):
        build_optimizer({"type": "SGD", "lr": 1.0, "paramwise": {"img_encoder": {}}},
                        model, objective)
    with pytest.raises(ValueError, match="unknown key\\(s\\) lr_multiplier"):
        build_optimizer({"type": "SGD", "lr": 1.0,
                         "paramwise": {"text_encoder": {"lr_multiplier": 2}}}, model, objective)
