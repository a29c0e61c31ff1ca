"""LoRA through peft (``model.peft``): what it adapts, what trains, the mistakes it refuses,
and a merge that embeds as the adapted model with the plain model's weights."""

import copy

import pytest
import torch
from clip_runs import MODEL_KWARGS

from mmgoal.engine.optimizers import build_optimizer, parameter_counts
from mmgoal.models.lora import AdapterCount, merge_adapters
from mmgoal.registry import MODELS, OBJECTIVES, ConfigError
from mmgoal.runs.schema import load_model_config
from mmgoal.structures import ObjectiveInputs

pytest.importorskip("open_clip")
pytest.importorskip("peft")

TINY = copy.deepcopy(MODEL_KWARGS)  # ViT-B-32 shrunk to one block of width 32 per tower
TOWERS = ("visual.transformer", "transformer")  # open_clip's image and text blocks


def open_clip_section(peft: dict | None = None) -> dict:
    section = {"type": "OpenCLIP", "model_name": "ViT-B-32", "model_kwargs": TINY}
    return section if peft is None else {**section, "peft": peft}


def make_batch(n: int = 4) -> dict:
    generator = torch.Generator().manual_seed(1)
    return {"images": torch.randn(n, 3, 32, 32, generator=generator),
            "tokens": torch.randint(1, 49407, (n, 16), generator=generator)}


def embed(model, batch: dict) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model.encode_image(batch).embedding,
                          model.encode_text(batch).embedding])


def test_lora_starts_from_the_model_trains_its_adapters_alone_and_merges_back():
    torch.manual_seed(0)
    plain = MODELS.build(open_clip_section()).eval()
    torch.manual_seed(0)  # the same weights: the adapters are drawn after them
    model = MODELS.build(open_clip_section({"type": "lora", "r": 4, "alpha": 8}))
    adapters = {f"model.{tower}.resblocks.0.attn.lora_{factor}.default.weight"
                for tower in TOWERS for factor in "AB"}
    assert {n for n, p in model.named_parameters() if p.requires_grad} == \
        adapters | {"model.logit_scale"}  # the temperature trains by default
    # A (4, 32) and B (96, 32 x 3 for queries, keys and values, 4) per tower, and the scale
    counts = parameter_counts(model)
    assert counts == {"trainable": 2 * (4 * 32 + 96 * 4) + 1,
                      "total": parameter_counts(plain)["total"] + 2 * (4 * 32 + 96 * 4)}
    batch = make_batch()
    assert torch.equal(embed(model.eval(), batch), embed(plain, batch))  # B starts at zero
    objective = OBJECTIVES.build({"type": "InfoNCELoss"}, model=model)
    optimizer = build_optimizer({"type": "AdamW", "lr": 1e-2}, model, objective)
    held = [p for group in optimizer.param_groups for p in group["params"]]
    assert {id(p) for p in held} == {id(p) for p in model.parameters() if p.requires_grad}
    before = {name: value.clone() for name, value in model.state_dict().items()}
    model.train()
    for _ in range(3):
        sims = model.similarity(model.encode_image(batch), model.encode_text(batch))
        objective(ObjectiveInputs(sims, model=model))["infonce_loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
    after = model.state_dict()
    # the frozen weights did not move by a bit (peft's adapter of the attention's
    # in_proj_weight is a parametrization: nothing is added to them and taken off again)
    assert {name for name in before if not torch.equal(before[name], after[name])} == \
        adapters | {"model.logit_scale"}
    adapted = embed(model.eval(), batch)
    assert not torch.allclose(adapted, embed(plain, batch), atol=1e-3)
    # the two towers' in_proj_weight, counted as the run's log counts them
    assert merge_adapters(model.model) == AdapterCount(layers=0, weights=2)
    assert model.state_dict().keys() == plain.state_dict().keys()
    torch.testing.assert_close(embed(model, batch), adapted, atol=1e-5, rtol=0)
    plain.load_state_dict(model.state_dict())
    torch.testing.assert_close(embed(plain, batch), adapted, atol=1e-5, rtol=0)


def test_lora_mistakes_are_config_errors_that_say_what_to_do():
    def model_config(peft, overrides=()):
        return load_model_config({"model": open_clip_section(peft)}, overrides)

    # checked with the config, before any model is built
    with pytest.raises(ConfigError, match=r"model.peft: adapter 'lora' got unknown config "
                                          r"key\(s\) 'alhpa' \(did you mean 'alpha'\?\); it "
                                          r"accepts: r, alpha, dropout, target_modules"):
        model_config({"type": "lora", "alhpa": 4})
    with pytest.raises(ConfigError, match=r"model.peft.r must be at least 1, got 0"):
        model_config({"type": "lora", "r": 0})
    with pytest.raises(ConfigError, match=r"model.peft.target_modules must be list or null, "
                                          r"got 'q_proj'"):
        model_config({"type": "lora", "target_modules": "q_proj"})
    with pytest.raises(ConfigError, match=r"'lorra' is not in the adapter registry. Did you "
                                          r"mean 'lora'\?"):
        model_config({"type": "lorra"})
    # an override may set a key the file left out
    assert model_config({"type": "lora"}, ["model.peft.alpha=32"])["model"]["peft"] == \
        {"type": "lora", "alpha": 32}
    # what only the model can tell, when it is built
    for peft, message in [
            ({"dropout": 1.5}, r"model.peft.dropout must lie in \[0, 1\), got 1.5"),
            ({"dropout": 0.1}, r"dropout 0.1 with target_parameters \(attn.in_proj_weight\): "
                               r"peft applies no dropout to an adapted parameter"),
            ({"target_modules": ["attn"]},
             r"'attn' names a torch nn.MultiheadAttention \(visual.transformer.resblocks.0."
             r"attn\), which LoRA through peft cannot adapt .* target_parameters: "
             r"\[attn.in_proj_weight\]"),
            ({"target_modules": ["out_proj"]},
             r"'out_proj' names the out_proj of a torch nn.MultiheadAttention"),
            ({"target_modules": ["q_proj"]},
             r"target_modules of OpenCLIP ViT-B-32: 'q_proj' names nothing in the model; its "
             r"layers end in attn.out_proj, mlp.c_fc, mlp.c_proj"),
            ({"target_parameters": ["in_proj"]}, r"'in_proj' names nothing in the model; its "
                                                 r"2-D weights end in attn.in_proj_weight"),
            ({"target_modules": [], "target_parameters": []}, r"LoRA would adapt nothing"),
            ({"trainable": ["logit_sacle"]},
             r"trainable of OpenCLIP ViT-B-32: the model has no parameter or module "
             r"'logit_sacle' \(its top-level parameters and modules: ln_final, logit_scale")]:
        with pytest.raises(ValueError, match=message):
            MODELS.build(open_clip_section({"type": "lora", **peft}))
    # layers alone may take dropout; trainable: [] trains the adapters alone
    model = MODELS.build(open_clip_section({"type": "lora", "r": 2, "dropout": 0.1,
                                            "target_modules": ["mlp.c_fc"], "trainable": []}))
    assert sorted(n for n, p in model.named_parameters() if p.requires_grad) == sorted(
        f"model.{tower}.resblocks.0.mlp.c_fc.lora_{factor}.default.weight"
        for tower in TOWERS for factor in "AB")


HF_TEXT = {"vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
           "num_attention_heads": 1}
HF_VISION = {"image_size": 16, "patch_size": 8, "hidden_size": 8, "intermediate_size": 8,
             "num_hidden_layers": 1, "num_attention_heads": 1}


@pytest.mark.parametrize("model_type", ["clip", "siglip"])
def test_hf_lora_adapts_the_encoder_attention_and_keeps_the_scale_and_bias_trainable(
        model_type):
    pytest.importorskip("transformers")
    config = {"model_type": model_type, "text_config": HF_TEXT, "vision_config": HF_VISION}
    torch.manual_seed(0)
    plain = MODELS.build({"type": "HFCLIP", "config": config})
    torch.manual_seed(0)
    model = MODELS.build({"type": "HFCLIP", "config": config, "peft": {"type": "lora", "r": 2}})
    adapted = {name.split(".lora_")[0] for name, _ in model.named_parameters()
               if ".lora_" in name}
    # SigLIP's pooling head (a torch MultiheadAttention, head.attention) is left alone
    assert adapted == {f"model.{tower}.encoder.layers.0.self_attn.{projection}"
                       for tower in ("text_model", "vision_model")
                       for projection in ("q_proj", "k_proj", "v_proj", "out_proj")}
    kept = {name for name, p in model.named_parameters()
            if p.requires_grad and ".lora_" not in name}
    assert kept == {"model.logit_scale", *(["model.logit_bias"] if model_type == "siglip"
                                           else [])}
    assert merge_adapters(model.model) == AdapterCount(layers=8, weights=0)
    assert model.state_dict().keys() == plain.state_dict().keys()
    assert not hasattr(model.model, "peft_config")  # save_pretrained writes the plain model


def test_a_tower_lock_on_a_lora_model_only_freezes():
    """open_clip's lock sets its unlocked groups trainable: LoRA's frozen base weights stay
    frozen, and counts open_clip would take as "all" are refused as HFCLIP's are."""
    model = MODELS.build(open_clip_section({"type": "lora", "r": 2, "alpha": 4}))
    before = {name for name, p in model.named_parameters() if p.requires_grad}
    model.lock_image_tower(2)  # of 3 groups: stem, the one block with ln_post, proj
    model.lock_text_tower(1)
    after = {name for name, p in model.named_parameters() if p.requires_grad}
    assert after < before and all("lora_" in name for name in after - {"model.logit_scale"})
    assert any("visual" in name for name in after)  # the last block's adapters train on
    with pytest.raises(ValueError, match="OpenCLIP ViT-B-32's image tower has 3 layer groups; "
                                         "3 unlocked would lock none"):
        MODELS.build(open_clip_section()).lock_image_tower(3)
