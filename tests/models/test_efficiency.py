"""Gradient checkpointing and torch.compile leave what the model computes unchanged."""

import pytest
import torch
from test_xvlm import CAPTIONS, TINY_BERT, TINY_VIT

from mmgoal.data.tokenizers import WordTokenizer
from mmgoal.models.efficiency import compile_model, enable_grad_checkpointing
from mmgoal.registry import MODELS

NO_DROPOUT = {"config": {**TINY_BERT["config"], "hidden_dropout_prob": 0.0,
                         "attention_probs_dropout_prob": 0.0}}


def hf_checkpointing(model) -> bool:
    """Whether a Hugging Face model checkpoints (the property's name changed in transformers 5)."""
    if hasattr(model, "is_activation_checkpointing"):
        return model.is_activation_checkpointing
    return model.is_gradient_checkpointing


def xvlm_gradients(tokenizer, **kwargs):
    """(model, gradients of a loss over ITC and ITM, forward calls of the first fusion layer)."""
    torch.manual_seed(0)
    model = MODELS.build({"type": "XVLM", "vision": TINY_VIT, "text": NO_DROPOUT,
                          "fusion_layers": 2, "embed_dim": 16, **kwargs}, tokenizer=tokenizer)
    model.train()
    calls = {"calls": 0}
    layer = model.fusion.layer[0]
    forward = layer.forward

    def counted(*args, **kwargs):  # forward hooks do not run again in a recomputation
        calls["calls"] += 1
        return forward(*args, **kwargs)

    layer.forward = counted
    torch.manual_seed(1)
    batch = {"images": torch.randn(4, 3, 32, 32), **tokenizer(CAPTIONS)}
    images, texts = model.encode_image(batch), model.encode_text(batch)
    loss = (model.similarity(images, texts).logsumexp(1).sum()
            + model.match_logits(images, texts)[:, 1].sum())
    loss.backward()
    return (model, {n: p.grad.clone() for n, p in model.named_parameters()
                    if p.grad is not None}, calls)


def test_grad_checkpointing_recomputes_every_tower_and_keeps_the_gradients():
    tokenizer = WordTokenizer().fit(CAPTIONS)
    plain_model, plain, plain_calls = xvlm_gradients(tokenizer)
    model, checkpointed, recomputed = xvlm_gradients(tokenizer, grad_checkpointing=True)
    assert model.vision.grad_checkpointing and model.fusion.grad_checkpointing
    assert hf_checkpointing(model.text) and not hf_checkpointing(plain_model.text)
    assert recomputed["calls"] == 2 * plain_calls["calls"]  # the fusion layer ran again
    assert checkpointed.keys() == plain.keys() and len(plain) > 20
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_grad_checkpointing_on_a_model_without_support_says_so():
    tokenizer = WordTokenizer().fit(CAPTIONS)
    cfg = {"type": "DualEncoder", "embed_dim": 8,
           "image_encoder": {"type": "TimmImageEncoder", "model_name": "mmgoal_small_cnn",
                             "model_kwargs": {"widths": [4, 8]}},
           "text_encoder": {"type": "GRUTextEncoder", "word_dim": 4, "hidden_size": 8}}
    with pytest.raises(ValueError, match=r"no part of DualEncoder \(TimmImageEncoder, "
                                         r"GRUTextEncoder.*supports gradient checkpointing"):
        MODELS.build({**cfg, "grad_checkpointing": True}, tokenizer=tokenizer)
    model = MODELS.build(cfg, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="remove the key"):
        enable_grad_checkpointing(model)


def test_compile_is_in_place_and_keeps_the_parameter_names():
    tokenizer = WordTokenizer().fit(CAPTIONS)
    torch.manual_seed(0)
    model = MODELS.build({"type": "XVLM", "vision": TINY_VIT, "text": TINY_BERT,
                          "fusion_layers": 2, "embed_dim": 16}, tokenizer=tokenizer)
    names = list(model.state_dict())
    compiled = compile_model(model)
    assert compiled == ["vision", "text", "fusion", "image_to_text", "vision_proj", "text_proj",
                        "itm_head"]
    assert list(model.state_dict()) == names  # no _orig_mod. prefix: checkpoints still load
    assert all(getattr(getattr(model, name), "_compiled_call_impl", None) is not None
               for name in compiled)
