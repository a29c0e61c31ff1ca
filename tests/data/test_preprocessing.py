"""The model's own preprocessing, used where the config leaves it null."""

import pytest
import timm
import torch
from PIL import Image

from mmgoal.data.transforms import build_transforms, default_transforms
from mmgoal.runs.preprocessing import resolve_preprocessing
from mmgoal.runs.schema import load_model_config

TOKENIZER = {"type": "WordTokenizer", "vocab": ["a", "red", "circle"]}


def dual_encoder(pretrained, model_name: str = "efficientnet_lite0") -> dict:
    return {"type": "DualEncoder", "embed_dim": 8,
            "image_encoder": {"type": "TimmImageEncoder", "model_name": model_name,
                              "pretrained": pretrained},
            "text_encoder": {"type": "GRUTextEncoder", "word_dim": 4, "hidden_size": 4}}


def resolved(model: dict, **data) -> dict:
    return load_model_config({"model": model, "data": {"tokenizer": TOKENIZER, **data}})


def image() -> Image.Image:
    generator = torch.Generator().manual_seed(0)
    return Image.fromarray((torch.rand(120, 90, 3, generator=generator) * 255).byte().numpy())


def test_a_pretrained_timm_tower_brings_timm_preprocessing():
    # the file is read when the model is built, not to decide its preprocessing
    preprocessing = resolve_preprocessing(resolved(dual_encoder("weights/effnet.pth")))
    own = [{"type": "TimmTransform", "model_name": "efficientnet_lite0"}]
    assert preprocessing.train_transforms == own and preprocessing.eval_transforms == own
    model = timm.create_model("efficientnet_lite0", pretrained=False)
    expected = timm.data.create_transform(**timm.data.resolve_model_data_config(model))
    got = build_transforms(preprocessing.eval_transforms, None)(image())
    assert got.shape == (3, 224, 224)
    torch.testing.assert_close(got, expected(image()), atol=0, rtol=0)
    # data.image_size sets the crop, with the model's statistics and crop ratio
    at_96 = resolve_preprocessing(resolved(dual_encoder("weights/effnet.pth"), image_size=96))
    assert at_96.eval_transforms == [{**own[0], "image_size": 96}]
    transform = build_transforms(at_96.eval_transforms, 96).transforms[0]
    assert [type(t).__name__ for t in transform.transforms] == [
        "Resize", "CenterCrop", "MaybeToTensor", "Normalize"]
    assert transform.transforms[0].size == int(96 / 0.875)


@pytest.mark.parametrize("model", [
    dual_encoder(None),  # random weights have no statistics of their own
    dual_encoder("weights/cnn.pth", "mmgoal_small_cnn"),  # nor a model timm has none for
])
def test_without_statistics_of_its_own_the_default_is_kept(model):
    preprocessing = resolve_preprocessing(resolved(model, image_size=32))
    assert preprocessing.train_transforms == preprocessing.eval_transforms == \
        default_transforms(32)
    assert default_transforms(None) == default_transforms(64)
    assert resolve_preprocessing(resolved(model)).eval_transforms == default_transforms(64)


def test_the_config_wins_and_a_missing_tokenizer_is_named():
    given = [{"type": "Resize", "size": [32, 32]}, {"type": "ToTensor"}]
    cfg = resolved(dual_encoder("weights/effnet.pth"), eval_transforms=given)
    preprocessing = resolve_preprocessing(cfg)
    assert preprocessing.eval_transforms == given
    assert preprocessing.train_transforms[0]["type"] == "TimmTransform"
    assert preprocessing.tokenizer == TOKENIZER
    assert cfg["data"]["tokenizer"] == TOKENIZER  # the config itself is not changed
    with pytest.raises(ValueError, match=r"the config has no data.tokenizer and DualEncoder "
                                         r"has no tokenizer of its own"):
        resolve_preprocessing(load_model_config({"model": dual_encoder(None)}))
