"""Parameter groups: paramwise multipliers, no weight decay where CLIP fine-tuning has none,
layer-wise lr decay of transformer towers."""

import pytest

from mmgoal.data.tokenizers import WordTokenizer
from mmgoal.engine.optimizers import build_optimizer, parameter_counts, transformer_layers
from mmgoal.registry import MODELS, OBJECTIVES
from mmgoal.runs.schema import check_components

# tests/models/test_xvlm.py's tiny timm ViT: two blocks of width 32
TINY_VIT = {"type": "TimmImageEncoder", "model_name": "vit_tiny_patch16_224",
            "model_kwargs": {"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 2,
                             "num_heads": 2}}
# a block's parameters: the matrices keep their weight decay under every no_decay kind
BLOCK_MATRICES = ("attn.qkv.weight", "attn.proj.weight", "mlp.fc1.weight", "mlp.fc2.weight")
BLOCK_VECTORS = ("norm1.weight", "norm1.bias", "attn.qkv.bias", "attn.proj.bias", "norm2.weight",
                 "norm2.bias", "mlp.fc1.bias", "mlp.fc2.bias")


def vit_dual_encoder():
    return MODELS.build({"type": "DualEncoder", "embed_dim": 8, "image_encoder": TINY_VIT,
                         "text_encoder": {"type": "GRUTextEncoder", "word_dim": 8,
                                          "hidden_size": 8}},
                        tokenizer=WordTokenizer(vocab=["a"]))


def rates(optimizer, model, objective):
    """Parameter name -> (lr, weight_decay, group name); the objective's as ``objective.*``."""
    names = {id(p): n for n, p in model.named_parameters()}
    names.update({id(p): f"objective.{n}" for n, p in objective.named_parameters()})
    return {names[id(p)]: (g["lr"], g["weight_decay"], g["name"])
            for g in optimizer.param_groups for p in g["params"]}


def test_without_the_new_options_the_groups_are_as_before():
    model, objective = vit_dual_encoder(), OBJECTIVES.build({"type": "InfoNCELoss"})
    optimizer = build_optimizer({"type": "AdamW", "lr": 1e-3, "weight_decay": 0.2},
                                model, objective)
    base, last = optimizer.param_groups
    assert base == {**base, "name": "base", "lr": 1e-3, "weight_decay": 0.2}
    assert [id(p) for p in base["params"]] == [id(p) for p in model.parameters()]  # same order
    assert last["name"] == "objective" and last["weight_decay"] == 0.2  # temperature decayed


def test_parameters_frozen_when_the_optimizer_is_built_are_in_no_group():
    """A LoRA model's base weights (model.peft) are frozen when it is built: the optimizer
    holds what trains, and the run counts it (tests/models/test_lora.py builds one)."""
    model, objective = vit_dual_encoder(), OBJECTIVES.build({"type": "InfoNCELoss"})
    model.image_encoder.requires_grad_(False)
    optimizer = build_optimizer({"type": "AdamW", "lr": 1e-3, "no_decay": ["bias"]},
                                model, objective)
    held = set(rates(optimizer, model, objective))
    trains = {n for n, p in model.named_parameters() if p.requires_grad}
    assert held == trains | {"objective.temperature"} and trains
    assert not any(name.startswith("image_encoder.") for name in held)
    frozen = sum(p.numel() for p in model.image_encoder.parameters())
    counts = parameter_counts(model, objective)
    assert counts["total"] - counts["trainable"] == frozen > 0
    assert counts["trainable"] == sum(p.numel() for g in optimizer.param_groups
                                      for p in g["params"])


@pytest.mark.parametrize("kind,excluded", [
    ("bias", {f"image_encoder.model.blocks.{i}.{n}" for i in (0, 1) for n in BLOCK_VECTORS
              if n.endswith("bias")} | {"image_encoder.model.patch_embed.proj.bias",
                                        "image_encoder.model.fc_norm.bias", "image_proj.bias",
                                        "text_proj.bias", "text_encoder.gru.bias_ih_l0",
                                        "text_encoder.gru.bias_hh_l0"}),
    ("norm", {f"image_encoder.model.blocks.{i}.norm{j}.{n}" for i in (0, 1) for j in (1, 2)
              for n in ("weight", "bias")} | {"image_encoder.model.fc_norm.weight",
                                               "image_encoder.model.fc_norm.bias"}),
    ("embedding", {"image_encoder.model.cls_token", "image_encoder.model.pos_embed",
                   "text_encoder.embedding.weight"}),
    ("temperature", {"objective.temperature"}),
])
def test_each_no_decay_kind_names_its_parameters(kind, excluded):
    model, objective = vit_dual_encoder(), OBJECTIVES.build({"type": "InfoNCELoss"})
    optimizer = build_optimizer({"type": "AdamW", "lr": 1e-3, "weight_decay": 0.2,
                                 "no_decay": [kind]}, model, objective)
    assert {name for name, (_, wd, _) in rates(optimizer, model, objective).items()
            if wd == 0} == excluded


def test_vector_is_open_clips_ndim_rule_and_norms_are_found_by_their_type():
    model, objective = vit_dual_encoder(), OBJECTIVES.build({"type": "InfoNCELoss"})
    optimizer = build_optimizer({"type": "AdamW", "weight_decay": 0.2, "no_decay": ["vector"]},
                                model, objective)
    table = rates(optimizer, model, objective)
    assert {n for n, (_, wd, _) in table.items() if wd == 0} == \
        {n for n, p in model.named_parameters() if p.ndim < 2} | {"objective.temperature"}
    # a BatchNorm in the small CNN: 1-D too, but caught by its module type
    cnn = MODELS.build({"type": "DualEncoder", "embed_dim": 8,
                        "image_encoder": {"type": "TimmImageEncoder",
                                          "model_name": "mmgoal_small_cnn",
                                          "model_kwargs": {"widths": [8, 16]}},
                        "text_encoder": {"type": "GRUTextEncoder", "word_dim": 4,
                                         "hidden_size": 4}}, tokenizer=WordTokenizer(vocab=["a"]))
    norms = {f"{path}.{leaf}" for path, module in cnn.named_modules()
             if type(module).__name__.startswith("BatchNorm")
             for leaf, _ in module.named_parameters(recurse=False)}
    optimizer = build_optimizer({"type": "SGD", "weight_decay": 0.1, "no_decay": ["norm"]},
                                cnn, objective)
    assert norms and {n for n, (_, wd, _) in rates(optimizer, cnn, objective).items()
                      if wd == 0} == norms


def test_layer_decay_and_no_decay_and_paramwise_combine_per_parameter():
    model, objective = vit_dual_encoder(), OBJECTIVES.build({"type": "InfoNCELoss"})
    optimizer = build_optimizer({
        "type": "AdamW", "lr": 8e-3, "weight_decay": 0.2,
        "paramwise": {"text_encoder": {"lr_mult": 0.5}},
        "no_decay": ["bias", "norm", "embedding", "temperature", "vector"],
        "layer_decay": {"rate": 0.5, "modules": ["image_encoder"]}}, model, objective)
    # 2 blocks: embeddings are layer 0 (x 0.5^3), block i layer i + 1 (x 0.5^(2 - i)), what
    # follows the blocks layer 3 (x 1); outside the tower the paramwise rates hold.
    vit = "image_encoder.model."
    expected = {
        vit + "cls_token": (1e-3, 0.0, "image_encoder.layer_0/no_decay"),
        vit + "pos_embed": (1e-3, 0.0, "image_encoder.layer_0/no_decay"),
        vit + "patch_embed.proj.weight": (1e-3, 0.2, "image_encoder.layer_0"),
        vit + "patch_embed.proj.bias": (1e-3, 0.0, "image_encoder.layer_0/no_decay"),
        **{f"{vit}blocks.{i}.{n}": (lr, 0.2, f"image_encoder.layer_{i + 1}")
           for i, lr in ((0, 2e-3), (1, 4e-3)) for n in BLOCK_MATRICES},
        **{f"{vit}blocks.{i}.{n}": (lr, 0.0, f"image_encoder.layer_{i + 1}/no_decay")
           for i, lr in ((0, 2e-3), (1, 4e-3)) for n in BLOCK_VECTORS},
        vit + "fc_norm.weight": (8e-3, 0.0, "image_encoder.layer_3/no_decay"),
        vit + "fc_norm.bias": (8e-3, 0.0, "image_encoder.layer_3/no_decay"),
        "text_encoder.embedding.weight": (4e-3, 0.0, "text_encoder/no_decay"),
        "text_encoder.gru.weight_ih_l0": (4e-3, 0.2, "text_encoder"),
        "text_encoder.gru.weight_hh_l0": (4e-3, 0.2, "text_encoder"),
        "text_encoder.gru.bias_ih_l0": (4e-3, 0.0, "text_encoder/no_decay"),
        "text_encoder.gru.bias_hh_l0": (4e-3, 0.0, "text_encoder/no_decay"),
        "image_proj.weight": (8e-3, 0.2, "base"),
        "image_proj.bias": (8e-3, 0.0, "base/no_decay"),
        "text_proj.weight": (8e-3, 0.2, "base"),
        "text_proj.bias": (8e-3, 0.0, "base/no_decay"),
        "objective.temperature": (8e-3, 0.0, "objective/no_decay"),
    }
    assert rates(optimizer, model, objective) == expected
    # one group per distinct (prefix, layer, decay), in the order of their first parameters
    assert [g["name"] for g in optimizer.param_groups][:3] == [
        "image_encoder.layer_0/no_decay", "image_encoder.layer_0",
        "image_encoder.layer_1/no_decay"]


def test_a_paramwise_prefix_outside_the_tower_keeps_its_name_beside_the_layer():
    model, objective = vit_dual_encoder(), OBJECTIVES.build({"type": "InfoNCELoss"})
    optimizer = build_optimizer({
        "type": "SGD", "lr": 1.0, "paramwise": {"image_encoder.model.blocks": {"lr_mult": 0.5}},
        "layer_decay": {"rate": 0.5, "modules": ["image_encoder"]}}, model, objective)
    table = rates(optimizer, model, objective)
    assert table["image_encoder.model.blocks.1.attn.qkv.weight"] == (
        0.25, 0.0, "image_encoder.model.blocks/image_encoder.layer_2")
    assert table["image_encoder.model.fc_norm.weight"] == (1.0, 0.0, "image_encoder.layer_3")


def hf_bert():
    from transformers import BertConfig, BertModel

    return BertModel(BertConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                intermediate_size=16, vocab_size=10, max_position_embeddings=8))


def hf_clip_vision():
    from transformers import CLIPVisionConfig, CLIPVisionModel

    return CLIPVisionModel(CLIPVisionConfig(hidden_size=16, intermediate_size=16,
                                            num_hidden_layers=3, num_attention_heads=2,
                                            image_size=16, patch_size=8))


def open_clip_clip():
    from open_clip.model import CLIP

    return CLIP(embed_dim=8, vision_cfg={"image_size": 16, "patch_size": 8, "width": 16,
                                         "layers": 2, "head_width": 8},
                text_cfg={"context_length": 4, "vocab_size": 10, "width": 16, "heads": 2,
                          "layers": 2})


def timm_swin():
    import timm

    return timm.create_model("swin_tiny_patch4_window7_224", img_size=32, patch_size=4,
                             window_size=2, embed_dim=8, depths=(1, 2), num_heads=(1, 1),
                             num_classes=0)


@pytest.mark.parametrize("build,path,sequence,blocks,outside", [
    # Hugging Face BERT: embeddings, encoder.layer.N, pooler
    (hf_bert, "", "encoder.layer", 2, {
        "embeddings.word_embeddings.weight": 0, "embeddings.position_embeddings.weight": 0,
        "embeddings.token_type_embeddings.weight": 0, "embeddings.LayerNorm.weight": 0,
        "embeddings.LayerNorm.bias": 0, "pooler.dense.weight": 3, "pooler.dense.bias": 3}),
    # Hugging Face CLIP's vision transformer: embeddings, pre-norm, encoder.layers.N, post-norm
    (hf_clip_vision, "", "encoder.layers", 3, {
        "embeddings.class_embedding": 0, "embeddings.patch_embedding.weight": 0,
        "embeddings.position_embedding.weight": 0, "pre_layrnorm.weight": 0,
        "pre_layrnorm.bias": 0, "post_layernorm.weight": 4, "post_layernorm.bias": 4}),
    # open_clip's image tower: its own class/positional embeddings before the blocks, its
    # own proj after them, though named_parameters lists it first
    (open_clip_clip, "visual", "transformer.resblocks", 2, {
        "class_embedding": 0, "positional_embedding": 0, "proj": 3, "conv1.weight": 0,
        "ln_pre.weight": 0, "ln_pre.bias": 0, "ln_post.weight": 3, "ln_post.bias": 3}),
    # open_clip's CLIP holds its text blocks alone: its token embedding and final norm lie
    # beside them, outside this tower, and keep the full rate
    (open_clip_clip, "transformer", "resblocks", 2, {}),
    # timm Swin: stages layers.N hold blocks.M; the stage counts
    (timm_swin, "", "layers", 2, {
        "patch_embed.proj.weight": 0, "patch_embed.proj.bias": 0, "patch_embed.norm.weight": 0,
        "patch_embed.norm.bias": 0, "norm.weight": 3, "norm.bias": 3}),
])
def test_transformer_layers_of_hugging_face_open_clip_and_timm_towers(build, path, sequence,
                                                                      blocks, outside):
    tower = build().get_submodule(path)
    layers, count = transformer_layers(tower, path)
    assert count == blocks
    assert {name: layer for name, layer in layers.items() if layer in (0, blocks + 1)} == outside
    for index in range(blocks):
        assert {layer for name, layer in layers.items()
                if name.startswith(f"{sequence}.{index}.")} == {index + 1}


@pytest.mark.parametrize("options,message", [
    ({"layer_decay": {"rate": 0.7, "modules": ["text_encoder"]}},
     "module 'text_encoder' holds no transformer blocks .*embedding.weight.* blocks.N \\(timm\\)"),
    ({"layer_decay": {"rate": 0.7, "modules": ["image_encoder.modle"]}},
     "optimizer.layer_decay.modules: the model has no module 'image_encoder.modle'"),
])
def test_layer_decay_needs_a_tower_with_blocks(options, message):
    model, objective = vit_dual_encoder(), OBJECTIVES.build({"type": "InfoNCELoss"})
    with pytest.raises(ValueError, match=message):
        build_optimizer({"type": "AdamW", **options}, model, objective)


def test_a_module_with_two_block_sequences_is_refused():
    with pytest.raises(ValueError, match="module 'model' holds two or more sequences of blocks "
                                         "\\(transformer.resblocks, visual.transformer.resblocks"
                                         "\\): name each tower"):
        transformer_layers(open_clip_clip(), "model")


@pytest.mark.parametrize("options,message", [
    ({"no_decay": ["bias", "nrom"]}, "optimizer.no_decay\\[1\\] must be bias, norm, embedding, "
                                     "temperature or vector, got 'nrom' \\(did you mean "
                                     "norm\\?\\)"),
    ({"no_decay": "bias"}, "optimizer.no_decay must be list"),
    ({"layer_decay": {"rate": 1.5, "modules": ["image_encoder"]}},
     "optimizer.layer_decay.rate must lie in \\(0, 1\\], got 1.5"),
    ({"layer_decay": {"rate": 0.7}}, "the config has no optimizer.layer_decay.modules"),
    ({"layer_decay": {"rate": 0.7, "modules": ["image_encoder", "image_encoder.model"]}},
     "'image_encoder.model' lies inside 'image_encoder'; name each tower once"),
    ({"layer_decay": {"rate": 0.7, "towers": []}},
     "unknown key\\(s\\) 'towers' in 'optimizer.layer_decay'"),
    ({"paramwise": {"text_encoder": 0.1}}, "optimizer.paramwise.text_encoder must be a mapping"),
])
def test_option_mistakes_are_caught_with_the_config_before_anything_is_built(options, message):
    with pytest.raises(ValueError, match=message):
        check_components({"optimizer": {"type": "AdamW", **options}})
