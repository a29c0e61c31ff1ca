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
    assert encoder.eval()({"images": torch.zeros(1, 3, 32, 32)}).shape == (1, 512)


def test_grid_encoder_gives_one_token_per_feature_map_position(tokenizer):
    torch.manual_seed(0)
    encoder = ENCODERS.build({"type": "TimmImageEncoder", "model_name": "mmgoal_small_cnn",
                              "model_kwargs": {"widths": [8, 16]}, "output": "grid"}).eval()
    images = torch.randn(2, 3, 32, 32)
    tokens, lengths = encoder({"images": images})
    feature_map = encoder.model.forward_features(images)  # (2, 16, 8, 8)
    assert tokens.shape == (2, 64, 16) and lengths.tolist() == [64, 64]
    torch.testing.assert_close(tokens[1, 8 * 3 + 5], feature_map[1, :, 3, 5])


def test_token_dropout_keeps_order_and_at_least_one_token():
    from mmgoal.models.encoders.timm_image import drop_tokens

    torch.manual_seed(0)
    tokens = torch.arange(2 * 50, dtype=torch.float32).reshape(2, 50, 1)
    lengths = torch.tensor([50, 30])
    kept, new_lengths = drop_tokens(tokens, lengths, 0.2)
    for row in range(2):
        values = kept[row, :new_lengths[row], 0]
        assert torch.all(values[1:] > values[:-1])  # order kept
        assert torch.all(values < row * 50 + lengths[row])  # padding never survives
        assert torch.all(kept[row, new_lengths[row]:] == 0)
    assert 0.6 < new_lengths.sum() / lengths.sum() < 0.95
    _, lone = drop_tokens(tokens, lengths, 1.0)
    assert lone.tolist() == [1, 1]


def test_gpo_dual_encoder_on_grid_tokens_and_gpo_words(tokenizer):
    torch.manual_seed(0)
    model = MODELS.build({
        "type": "DualEncoder", "embed_dim": 12,
        "image_encoder": {"type": "TimmImageEncoder", "model_name": "mmgoal_small_cnn",
                          "model_kwargs": {"widths": [8, 16]}, "output": "grid",
                          "token_dropout": 0.2},
        "image_pooler": {"type": "GPO", "d_pe": 8, "d_hidden": 8},
        "image_projection": "mlp",
        "text_encoder": {"type": "GRUTextEncoder", "word_dim": 8, "hidden_size": 12,
                         "bidirectional": True},
        "text_pooler": {"type": "GPO", "d_pe": 8, "d_hidden": 8},
    }, tokenizer=tokenizer).eval()
    batch = {"images": torch.randn(2, 3, 32, 32), **tokenizer(["a red circle", "a star"])}
    with torch.no_grad():
        images, texts = model.encode_image(batch), model.encode_text(batch)
    torch.testing.assert_close(images.embedding.norm(dim=-1), torch.ones(2))
    assert images.tokens.shape == (2, 64, 12) and texts.mask.sum(1).tolist() == [3, 2]
    # the words of "a star" pooled by hand: projected states sorted per channel, GPO weights
    states = model.text_proj(model.text_encoder.forward_tokens(batch["tokens"],
                                                               batch["lengths"]))[1, :2]
    weights = model.text_pooler.pool_weights(torch.tensor([2]), 2)[0]
    expected = (states.sort(0, descending=True).values * weights[:, None]).sum(0)
    torch.testing.assert_close(texts.embedding[1], torch.nn.functional.normalize(expected, dim=0))


def test_dual_encoder_asks_for_a_pooler_when_the_encoder_returns_tokens(tokenizer):
    cfg = {"type": "DualEncoder", "embed_dim": 8,
           "image_encoder": {"type": "PrecomputedRegionEncoder", "feature_dim": 6},
           "text_encoder": {"type": "GRUTextEncoder", "word_dim": 4, "hidden_size": 4}}
    with pytest.raises(ValueError, match="returns tokens: set model.image_pooler"):
        MODELS.build(cfg, tokenizer=tokenizer)
    cfg["image_encoder"] = {"type": "TimmImageEncoder", "model_name": "mmgoal_small_cnn",
                            "model_kwargs": {"widths": [4]}}
    with pytest.raises(ValueError, match="remove model.image_pooler"):
        MODELS.build({**cfg, "image_pooler": {"type": "GPO"}}, tokenizer=tokenizer)


def test_precomputed_regions_with_mlp_projection_ignore_padding(tokenizer):
    torch.manual_seed(0)
    model = MODELS.build({
        "type": "DualEncoder", "embed_dim": 8,
        "image_encoder": {"type": "PrecomputedRegionEncoder", "feature_dim": 6},
        "image_pooler": {"type": "GPO", "d_pe": 8, "d_hidden": 8}, "image_projection": "mlp",
        "text_encoder": {"type": "GRUTextEncoder", "word_dim": 4, "hidden_size": 4},
    }, tokenizer=tokenizer)
    regions = torch.randn(2, 5, 6)
    model.train()
    model.encode_image({"regions": regions, "region_lengths": torch.tensor([5, 3])})
    model.eval()
    with torch.no_grad():
        both = model.encode_image({"regions": regions, "region_lengths": torch.tensor([5, 3])})
        alone = model.encode_image({"regions": regions[1:, :3],
                                    "region_lengths": torch.tensor([3])})
    torch.testing.assert_close(both.embedding[1], alone.embedding[0])
    with pytest.raises(ValueError, match="set feature_dim: 7"):
        model.encode_image({"regions": torch.randn(1, 2, 7), "region_lengths": torch.tensor([2])})
    with pytest.raises(KeyError, match="regions.npy"):
        model.encode_image({"images": torch.randn(1, 3, 8, 8)})


def test_roi_regions_do_not_depend_on_the_other_images_of_the_batch():
    from torchvision.ops import roi_align

    torch.manual_seed(0)
    encoder = ENCODERS.build({"type": "RoIRegionEncoder", "model_name": "mmgoal_small_cnn",
                              "model_kwargs": {"widths": [8, 16]}}).eval()
    images = torch.randn(2, 3, 32, 32)
    boxes = torch.tensor([[[0.1, 0.1, 0.5, 0.6], [0.0, 0.0, 0.0, 0.0]],
                          [[0.2, 0.3, 0.9, 0.8], [0.5, 0.0, 1.0, 0.5]]])
    with torch.no_grad():
        tokens, lengths = encoder({"images": images, "boxes": boxes,
                                   "box_lengths": torch.tensor([1, 2])})
        alone, _ = encoder({"images": images[:1], "boxes": boxes[:1, :1],
                            "box_lengths": torch.tensor([1])})
        feature_map = encoder.model.forward_features(images[1:])
    assert lengths.tolist() == [2, 3] and tokens.shape == (2, 3, 16)
    torch.testing.assert_close(tokens[0, :2], alone[0])
    assert torch.all(tokens[0, 2] == 0)
    by_hand = roi_align(feature_map, [torch.tensor([[16.0, 0.0, 32.0, 16.0]])], 2,
                        spatial_scale=8 / 32, sampling_ratio=2, aligned=True).mean((2, 3))
    torch.testing.assert_close(tokens[1, 2], by_hand[0])


def test_timm_model_kwargs_of_another_model_are_a_sentence():
    # widths belong to mmgoal_small_cnn: left over after model_name became resnet18
    with pytest.raises(ValueError, match=r"timm model 'resnet18' does not take model_kwargs "
                                         r"\['widths'\] .*they may belong to another "
                                         r"model_name"):
        ENCODERS.build({"type": "TimmImageEncoder", "model_name": "resnet18",
                        "model_kwargs": {"widths": [8, 16]}})
