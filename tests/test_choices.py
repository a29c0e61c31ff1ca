"""Choices in type hints (``Literal[...]``): a value outside them is refused by the one
check (mmgoal/config.py ``check_value``), naming the key, the choices and the closest."""

import pytest

import mmgoal  # noqa: F401  (registers every component)
from mmgoal.config import Precision, check_value
from mmgoal.data.classification import write_synthetic_classification
from mmgoal.models.dual_encoder import build_projection
from mmgoal.objectives.goal_loss import GoalLoss
from mmgoal.registry import (
    CONSTRAINTS,
    ENCODERS,
    LOGGERS,
    MODELS,
    OBJECTIVES,
    STRATEGIES,
    TOKENIZERS,
    ConfigError,
)


@pytest.mark.parametrize("value,hint,message", [
    ("fp8", Precision, r"^k must be fp32, bf16 or fp16, got 'fp8'$"),
    ("bf61", Precision, r"^k must be fp32, bf16 or fp16, got 'bf61' \(did you mean bf16\?\)$"),
    ("x", Precision | None, r"^k must be fp32, bf16, fp16 or null, got 'x'$"),
    ("5", float | None, r"^k must be a number or null, got '5'$"),
])
def test_a_value_outside_the_choices_lists_them(value, hint, message):
    with pytest.raises(ValueError, match=message):
        check_value("k", value, hint)


# (registry, config, the message): each built-in component's choices, checked before it builds
CHOICES = [
    (STRATEGIES, {"type": "deepspeed", "zero_stage": 4}, "zero_stage must be 0, 1, 2 or 3, got 4"),
    (STRATEGIES, {"type": "accelerate", "mixed_precision": "fp32"},
     "mixed_precision must be no, bf16, fp16 or null, got 'fp32'"),
    (LOGGERS, {"type": "WandbLogger", "mode": "offlin"},
     "mode must be online, offline, disabled or null, got 'offlin' (did you mean offline?)"),
    (OBJECTIVES, {"type": "TripletLoss", "reduction": "avg"},
     "reduction must be sum or mean, got 'avg'"),
    (OBJECTIVES, {"type": "GoalObjective", "reduction": "means"},
     "reduction must be sum or mean, got 'means' (did you mean mean?)"),
    (OBJECTIVES, {"type": "ITMLoss", "pairs": "all"}, "pairs must be local or global, got 'all'"),
    (CONSTRAINTS, {"type": "CCSConstraint", "reduction": "max"},
     "reduction must be sum or mean, got 'max'"),
    (TOKENIZERS, {"type": "HFTokenizer", "path": "p", "padding": "max"},
     "padding must be longest or max_length, got 'max'"),
    (ENCODERS, {"type": "TimmImageEncoder", "model_name": "m", "output": "grids"},
     "output must be pooled or grid, got 'grids' (did you mean grid?)"),
    (ENCODERS, {"type": "GRUTextEncoder", "pooling": "max"},
     "pooling must be last or mean, got 'max'"),
    (ENCODERS, {"type": "HFTextEncoder", "config": {}, "pooling": "max"},
     "pooling must be cls or mean, got 'max'"),
    (MODELS, {"type": "SCAN", "image_encoder": {}, "text_encoder": {}, "direction": "i2i"},
     "direction must be t2i or i2t, got 'i2i' (did you mean t2i?)"),
    (MODELS, {"type": "DualEncoder", "image_encoder": {}, "text_encoder": {},
              "text_projection": "mpl"},
     "text_projection must be linear, mlp or none, got 'mpl' (did you mean mlp?)"),
    (MODELS, {"type": "XVLM", "vision": {}, "text": {}, "mlm_head": "shared"},
     "mlm_head must be tied, separate or null, got 'shared'"),
]


@pytest.mark.parametrize("registry,cfg,message", CHOICES,
                         ids=[f"{cfg['type']}-{message.split()[0]}" for _, cfg, message in CHOICES])
def test_a_component_refuses_a_value_outside_its_choices(registry, cfg, message):
    with pytest.raises(ConfigError) as caught:
        registry.check(cfg, "section", provided=registry.required(cfg["type"]))
    assert str(caught.value) == f"section.{message}"


def test_a_choice_passed_from_python_is_checked_where_it_is_used():
    with pytest.raises(ValueError, match=r"^reduction must be sum or mean, got 'avg'$"):
        GoalLoss(reduction="avg")
    with pytest.raises(ValueError, match=r"^image_projection must be linear, mlp or none"):
        build_projection("identity", 4, 4, "image")
    with pytest.raises(ValueError, match=r"^task must be shape or colour, got 'color' \(did you "
                                         r"mean colour\?\)$"):
        write_synthetic_classification("unused", task="color")


def test_a_registered_class_built_in_python_refuses_a_value_outside_its_choices():
    from mmgoal.engine.strategies.torch_native import TorchStrategy
    from mmgoal.objectives.triplet import TripletLoss

    with pytest.raises(ValueError, match=r"^reduction must be sum or mean, got 'avg'$"):
        TripletLoss(margin=0.2, reduction="avg")
    with pytest.raises(ValueError, match=r"^precision must be fp32, bf16 or fp16, got 'fp8'$"):
        TorchStrategy(device="cpu", precision="fp8")
    assert TripletLoss(0.2, True, "mean").reduction == "mean"  # positional, within
    # the registry's check of a config still names the section
    with pytest.raises(ConfigError,
                       match=r"^objective 'TripletLoss': reduction must be sum or mean"):
        OBJECTIVES.build({"type": "TripletLoss", "reduction": "avg"})
