"""Sizes in type hints (mmgoal/config.py ``PositiveInt``): a width, a length or a count of
layers below 1 is a config error that names the key, wherever a config sets it."""

import dataclasses
from collections.abc import Sequence

import pytest

import mmgoal  # noqa: F401  (registers every component)
from mmgoal.config import ConfigSection, PositiveInt, check_value
from mmgoal.models.encoders.small_cnn import SmallCNN
from mmgoal.registry import (
    ENCODERS,
    MODELS,
    POOLERS,
    TOKENIZERS,
    TRANSFORMS,
    ConfigError,
    check_arguments,
)


@pytest.mark.parametrize("value,hint,message", [
    (-1, PositiveInt, r"^k must be at least 1, got -1$"),
    (0, PositiveInt | None, r"^k must be at least 1, got 0$"),
    ("8", PositiveInt, r"^k must be an integer, got '8'$"),
    (1.5, PositiveInt | None, r"^k must be an integer or null, got 1.5$"),
    ([8, 0], Sequence[PositiveInt], r"^k\[1\] must be at least 1, got 0$"),
    ((8, -2), tuple[PositiveInt, ...], r"^k\[1\] must be at least 1, got -2$"),
    ([8, "x"], list[PositiveInt], r"^k\[1\] must be an integer, got 'x'$"),
    (["a", 2], list[str], r"^k\[1\] must be a string, got 2$"),
])
def test_a_bound_or_an_item_that_does_not_fit_names_the_key(value, hint, message):
    with pytest.raises(ValueError, match=message):
        check_value("k", value, hint)


@pytest.mark.parametrize("value,hint", [
    (1, PositiveInt), (None, PositiveInt | None), ([8, 16], list[PositiveInt]),
    ((1,), tuple[PositiveInt, ...]), ([], Sequence[PositiveInt]), ("abc", str),
])
def test_values_within_the_bounds_pass(value, hint):
    check_value("k", value, hint)


def test_a_config_section_field_keeps_its_bound():
    @dataclasses.dataclass
    class Section(ConfigSection):
        length: PositiveInt = 4

    assert Section.from_dict({"length": 2}, "data").length == 2
    with pytest.raises(ValueError, match=r"^data.length must be at least 1, got 0$"):
        Section.from_dict({"length": 0}, "data")


# (registry, type, key): sizes of the built-in components that zero or less would not mean
SIZES = [
    (TOKENIZERS, "WordTokenizer", "max_length"),
    (TOKENIZERS, "HFTokenizer", "max_length"),
    (TOKENIZERS, "OpenCLIPTokenizer", "context_length"),
    (MODELS, "DualEncoder", "embed_dim"),
    (MODELS, "SCAN", "embed_dim"),
    (MODELS, "XVLM", "embed_dim"),
    (MODELS, "XVLM", "fusion_layers"),
    (ENCODERS, "GRUTextEncoder", "word_dim"),
    (ENCODERS, "GRUTextEncoder", "hidden_size"),
    (ENCODERS, "GRUTextEncoder", "num_layers"),
    (ENCODERS, "PrecomputedRegionEncoder", "feature_dim"),
    (ENCODERS, "RoIRegionEncoder", "output_size"),
    (POOLERS, "GPO", "d_pe"),
    (POOLERS, "GPO", "d_hidden"),
    (TRANSFORMS, "OpenCLIPTransform", "image_size"),
]


@pytest.mark.parametrize("registry,name,key", SIZES,
                         ids=[f"{name}.{key}" for _, name, key in SIZES])
@pytest.mark.parametrize("value", [0, -1])
def test_a_built_in_size_below_one_is_refused_before_building(registry, name, key, value):
    with pytest.raises(ConfigError, match=rf"^data.x.{key} must be at least 1, got {value}$"):
        registry.check({"type": name, key: value}, "data.x",
                       provided=registry.required(name))
    with pytest.raises(ConfigError) as caught:  # with the keys it lacks, said together
        registry.build({"type": name, key: value})
    assert f"{registry.name} '{name}': {key} must be at least 1, got {value}" in [
        str(problem) for problem in getattr(caught.value, "problems", [caught.value])]


def test_a_small_cnn_width_below_one_is_refused_in_timms_call():
    # model_kwargs reach SmallCNN through timm.create_model, past the registry
    with pytest.raises(ValueError, match=r"^mmgoal_small_cnn.widths\[1\] must be at least 1, "
                                         r"got 0$"):
        ENCODERS.build({"type": "TimmImageEncoder", "model_name": "mmgoal_small_cnn",
                        "model_kwargs": {"widths": [8, 0]}})
    with pytest.raises(ValueError, match=r"^where.in_chans must be an integer, got '3'$"):
        check_arguments(SmallCNN, {"in_chans": "3", "not_a_parameter": -1}, "where")
    check_arguments(SmallCNN, {"widths": [8, 16], "in_chans": 1})
