"""A config that claims a far larger model than its weights file holds is refused before the
model is allocated (mmgoal/models/pretrained.py check_weights_fit): an open_clip local-dir
folder, a pretrained file with model_kwargs, a Hugging Face folder."""

import copy
import json
import resource

import pytest
import torch
from hf_folders import tiny_hf_folder
from test_received_files import TINY_CLIP  # tests/: pytest puts it on sys.path

from mmgoal.models.pretrained import weights_file_shapes
from mmgoal.registry import MODELS

# far above what the refused builds take, far below the gigabytes the claimed models need
PEAK_BOUND = 500 * 2**20
HUGE = 10_000_000  # an embed_dim: two (32, 10**7) float32 projections, 2.5 GB


def peak_rss() -> int:
    """This process's peak resident memory so far, in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@pytest.fixture(scope="module")
def open_clip_folder(tmp_path_factory):
    """A tiny open_clip model in its folder layout (open_clip_config.json and
    open_clip_model.safetensors, as mmgoal export --format open_clip writes), and its name."""
    open_clip = pytest.importorskip("open_clip")
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("open_clip")
    (root / "weights-fit-tiny.json").write_text(json.dumps(TINY_CLIP))
    open_clip.add_model_config(root / "weights-fit-tiny.json")
    torch.manual_seed(0)
    model = open_clip.create_model("weights-fit-tiny")
    folder = root / "folder"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(folder / "open_clip_model.safetensors"))
    torch.save({"state_dict": {f"module.{k}": v for k, v in model.state_dict().items()}},
               root / "epoch_1.pt")
    (folder / "open_clip_config.json").write_text(json.dumps({"model_cfg": TINY_CLIP,
                                                              "preprocess_cfg": {}}))
    return folder, model


def test_a_local_dir_config_claiming_a_huge_model_is_refused_unallocated(open_clip_folder,
                                                                         tmp_path):
    folder, model = open_clip_folder
    section = {"type": "OpenCLIP", "model_name": f"local-dir:{folder}"}
    loaded = MODELS.build(section)  # the folder as written loads, with its weights
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[name], tensor), name
    claimed = tmp_path / "claimed"
    claimed.mkdir()
    (claimed / "open_clip_model.safetensors").symlink_to(folder / "open_clip_model.safetensors")
    (claimed / "open_clip_config.json").write_text(json.dumps(
        {"model_cfg": {**TINY_CLIP, "embed_dim": HUGE}, "preprocess_cfg": {}}))
    before = peak_rss()
    with pytest.raises(ValueError, match=rf"^OpenCLIP local-dir:{claimed}: its "
                                         rf"open_clip_config.json describes a model of "
                                         rf"641,633,889 values, more than 2 times the 1,634,913 "
                                         rf"that {claimed}/open_clip_model.safetensors holds "
                                         rf"\(shapes differ: text_projection \(32, 16\) in the "
                                         rf"file vs \(32, {HUGE}\); visual.proj \(32, 16\) in "
                                         rf"the file vs \(32, {HUGE}\)\): they do not belong "
                                         rf"together, .* use the config the weights were saved "
                                         rf"with$"):
        MODELS.build({**section, "model_name": f"local-dir:{claimed}"})
    assert peak_rss() - before < PEAK_BOUND


def test_a_pretrained_file_with_model_kwargs_claiming_a_huge_model_is_refused(open_clip_folder):
    folder, _ = open_clip_folder
    weights = folder.parent / "epoch_1.pt"  # a torch file, read mapped: {"state_dict": module.}
    section = {"type": "OpenCLIP", "model_name": "weights-fit-tiny", "pretrained": str(weights)}
    MODELS.build(section)
    before = peak_rss()
    with pytest.raises(ValueError, match=rf"^OpenCLIP weights-fit-tiny: architecture "
                                         rf"weights-fit-tiny with its model_kwargs describes a "
                                         rf"model of 641,633,889 values, more than 2 times the "
                                         rf"1,634,913 that {weights} holds"):
        MODELS.build({**section, "model_kwargs": {"embed_dim": HUGE}})
    assert peak_rss() - before < PEAK_BOUND


def test_a_hugging_face_config_claiming_a_huge_model_is_refused_unallocated(tmp_path):
    # transformers 5.24 allocates every tensor the file does not fill before it refuses the
    # mismatch: 2.5 GB here, from a 4 MB file
    folder = tiny_hf_folder(tmp_path / "clip", "clip")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "projection_dim": HUGE}))
    before = peak_rss()
    with pytest.raises(ValueError, match=rf"^HFCLIP path '{folder}': its config.json describes "
                                         rf"a model of [\d,]+ values, more than 2 times the "
                                         rf"[\d,]+ that model.safetensors holds \(shapes differ: "
                                         rf"text_projection.weight \(16, 32\) in the file vs "
                                         rf"\({HUGE}, 32\)"):
        MODELS.build({"type": "HFCLIP", "path": str(folder)})
    assert peak_rss() - before < PEAK_BOUND


def test_a_weights_file_is_listed_without_its_values(tmp_path):
    from safetensors.torch import save_file

    tensors = {"a.weight": torch.zeros(3, 4), "b": torch.zeros(5)}
    save_file(tensors, str(tmp_path / "w.safetensors"))
    torch.save({"state_dict": {f"module.{k}": v for k, v in tensors.items()}}, tmp_path / "w.pt")
    expected = {"a.weight": (3, 4), "b": (5,)}
    assert weights_file_shapes(tmp_path / "w.safetensors") == expected
    assert weights_file_shapes(tmp_path / "w.pt") == expected
    # a file it cannot list unread is left to its library
    (tmp_path / "w.npz").write_bytes(b"not read")
    (tmp_path / "legacy.pt").write_bytes(b"not a zip file")
    assert weights_file_shapes(tmp_path / "w.npz") is None
    assert weights_file_shapes(tmp_path / "legacy.pt") is None


def test_a_few_values_the_library_fills_in_are_no_reason_to_refuse(open_clip_folder):
    # open_clip adds a zero logit_bias or resizes a position table; transformers initialises
    # a missing pooler: within twice the file's values, the library decides
    folder, model = open_clip_folder
    kwargs = copy.deepcopy(TINY_CLIP)
    kwargs["vision_cfg"]["image_size"] = 64  # 2x2 -> 4x4 patches: a larger position table
    built = MODELS.build({"type": "OpenCLIP", "model_name": "weights-fit-tiny",
                          "pretrained": str(folder / "open_clip_model.safetensors"),
                          "model_kwargs": {"vision_cfg": kwargs["vision_cfg"]}})
    assert built.model.visual.positional_embedding.shape == (17, 32)
    assert torch.equal(built.model.text_projection, model.text_projection)
