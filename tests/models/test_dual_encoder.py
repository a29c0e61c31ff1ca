import pytest
import torch

from mmgoal.data.tokenizers import HFTokenizer, WordTokenizer
from mmgoal.models.encoders.small_cnn import SmallCNN
from mmgoal.registry import ENCODERS, MODELS

TINY_BERT = {"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 2,
             "num_attention_heads": 2, "intermediate_size": 64, "max_position_embeddings": 64}


@pytest.fixture
def tokenizer():
    return WordTokenizer().fit(["a red circle", "a blue square to the left of a star"])


def dual_encoder(tokenizer, text_encoder):
    return MODELS.build({
        "type": "DualEncoder", "embed_dim": 24,
        "image_encoder": {"type": "TimmImageEncoder", "model_name": "mmgoal_small_cnn",
                          "model_kwargs": {"widths": [8, 16]}},
        "text_encoder": text_encoder,
    }, tokenizer=tokenizer)


@pytest.mark.parametrize("text_encoder", [
    {"type": "GRUTextEncoder", "word_dim": 8, "hidden_size": 12},
    {"type": "GRUTextEncoder", "word_dim": 8, "hidden_size": 12, "bidirectional": True,
     "pooling": "mean"},
    {"type": "HFTextEncoder", "config": TINY_BERT},
])
def test_dual_encoder_scores_are_cosines_of_unit_embeddings(tokenizer, text_encoder):
    torch.manual_seed(0)
    model = dual_encoder(tokenizer, text_encoder).eval()
    batch = {"images": torch.randn(3, 3, 32, 32),
             **tokenizer(["a red circle", "a blue square", "a star to the left of a circle"])}
    images, texts = model.encode_image(batch), model.encode_text(batch)
    assert images.embedding.shape == (3, 24) and texts.embedding.shape == (3, 24)
    torch.testing.assert_close(images.embedding.norm(dim=-1), torch.ones(3))
    sims = model.similarity(images, texts)
    expected = torch.nn.functional.cosine_similarity(
        images.embedding[:, None], texts.embedding[None], dim=-1)
    torch.testing.assert_close(sims, expected)


def test_text_encoders_ignore_padding(tokenizer):
    torch.manual_seed(0)
    for cfg in ({"type": "GRUTextEncoder", "word_dim": 8, "hidden_size": 12},
                {"type": "GRUTextEncoder", "word_dim": 8, "hidden_size": 12,
                 "bidirectional": True, "pooling": "mean"},
                {"type": "HFTextEncoder", "config": TINY_BERT, "pooling": "mean"}):
        encoder = ENCODERS.build(cfg, tokenizer=tokenizer).eval()
        alone = tokenizer(["a red circle"])
        padded = tokenizer(["a red circle", "a blue square to the left of a star"])
        with torch.no_grad():
            one = encoder(alone["tokens"], alone["lengths"])
            two = encoder(padded["tokens"], padded["lengths"])
        torch.testing.assert_close(one[0], two[0], atol=1e-5, rtol=1e-5)


def test_bidirectional_last_state_averages_both_directions(tokenizer):
    torch.manual_seed(0)
    encoder = ENCODERS.build({"type": "GRUTextEncoder", "word_dim": 8, "hidden_size": 12,
                              "bidirectional": True}, tokenizer=tokenizer)
    batch = tokenizer(["a red circle"])
    states, _ = encoder.gru(encoder.embedding(batch["tokens"]))
    forward_last, backward_first = states[0, -1, :12], states[0, 0, 12:]
    torch.testing.assert_close(encoder(batch["tokens"], batch["lengths"])[0],
                               (forward_last + backward_first) / 2)


def test_hf_encoder_and_tokenizer_load_from_a_local_folder(tmp_path, tokenizer):
    from transformers import BertTokenizerFast

    torch.manual_seed(0)
    built = ENCODERS.build({"type": "HFTextEncoder", "config": TINY_BERT},
                           tokenizer=tokenizer).eval()
    built.model.save_pretrained(tmp_path)
    (tmp_path / "vocab.txt").write_text("\n".join(
        ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "red", "circle"]) + "\n")
    BertTokenizerFast(vocab=str(tmp_path / "vocab.txt")).save_pretrained(tmp_path)
    loaded = ENCODERS.build({"type": "HFTextEncoder", "model_path": str(tmp_path)}).eval()
    hf_tokenizer = HFTokenizer(str(tmp_path))
    batch = hf_tokenizer(["a red circle", "a circle"])
    assert batch["tokens"][0].tolist() == [2, 5, 6, 7, 3]
    assert batch["lengths"].tolist() == [5, 4]
    with torch.no_grad():
        torch.testing.assert_close(built(batch["tokens"], batch["lengths"]),
                                   loaded(batch["tokens"], batch["lengths"]))
    with pytest.raises(ValueError, match="exactly one of model_path or config"):
        ENCODERS.build({"type": "HFTextEncoder"})


def test_small_cnn_is_a_timm_model_with_coordinates():
    import timm

    model = timm.create_model("mmgoal_small_cnn", num_classes=0, widths=[8, 16])
    assert isinstance(model, SmallCNN) and model.num_features == 16
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 16)
    # with coordinate channels, the same blob at two places gives different features
    model.eval()
    left, right = torch.zeros(1, 3, 32, 32), torch.zeros(1, 3, 32, 32)
    left[..., 10:14, 2:6] = 1
    right[..., 10:14, 26:30] = 1
    assert not torch.allclose(model(left), model(right))
    with pytest.raises(ValueError, match="no pretrained weights"):
        timm.create_model("mmgoal_small_cnn", pretrained=True)
    with pytest.raises(ValueError, match="timm has no model 'resnet5000'"):
        ENCODERS.build({"type": "TimmImageEncoder", "model_name": "resnet5000"})


def test_timm_backbones_build_by_name():
    encoder = ENCODERS.build({"type": "TimmImageEncoder", "model_name": "resnet18",
                              "model_kwargs": {"drop_rate": 0.1}})
    assert encoder.out_dim == 512
    assert encoder.eval()(torch.zeros(1, 3, 32, 32)).shape == (1, 512)
