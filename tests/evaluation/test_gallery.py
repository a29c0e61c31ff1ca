import io
import json

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from mmgoal.data.pipeline import EvalReader
from mmgoal.data.shards import ShardWriter
from mmgoal.data.transforms import build_transforms
from mmgoal.engine.trainer import Trainer
from mmgoal.evaluation.attention import evaluate_attention
from mmgoal.evaluation.gallery import (
    Member,
    block_sizes,
    encode_gallery,
    evaluate_retrieval,
    gallery_similarity,
    score_gallery,
)
from mmgoal.evaluation.retrieval import retrieval_metrics
from mmgoal.structures import ImageFeatures, TextFeatures

SCAN_MODEL = {
    "type": "SCAN", "embed_dim": 16,
    "image_encoder": {"type": "RoIRegionEncoder", "model_name": "mmgoal_small_cnn",
                      "model_kwargs": {"widths": [8, 16]}, "output_size": 1},
    "text_encoder": {"type": "GRUTextEncoder", "word_dim": 8, "hidden_size": 16,
                     "bidirectional": True},
}


def scan_config(out, **extra):
    return {
        "model": dict(SCAN_MODEL),
        "objective": {"type": "TripletLoss", "margin": 0.2, "max_violation": True},
        "optimizer": {"type": "AdamW", "lr": 3e-3},
        "data": {
            "image_size": 32, "num_workers": 0, "eval_batch_size": 16,
            "tokenizer": {"type": "WordTokenizer"},
            "train": {"type": "ShardDataset", "shards": str(out / "train-{000000..000002}.tar"),
                      "batch_size": 16, "shuffle_buffer": 32},
            "val": {"shards": str(out / "val-000000.tar")},
            "test": {"shards": str(out / "test-{000000..000001}.tar")},
        },
        "train": {"epochs": 1, "progress": False, "log_every": 1},
        "evaluation": {"block_images": 8, "max_block_mb": 0.05},
        **extra,
    }


def random_features(n, length, dim, cls, generator):
    lengths = torch.randint(1, length + 1, (n,), generator=generator)
    mask = torch.arange(length)[None] < lengths[:, None]
    tokens = F.normalize(torch.randn(n, length, dim, generator=generator), dim=-1) * mask[..., None]
    return cls(F.normalize(tokens.sum(1), dim=-1), tokens=tokens, mask=mask)


def test_sharded_scoring_equals_the_unsharded_matrix(tiny_benchmark):
    from mmgoal.data.tokenizers import WordTokenizer
    from mmgoal.registry import MODELS

    torch.manual_seed(0)
    model = MODELS.build({**SCAN_MODEL, "direction": "i2t", "pooling": "lse"},
                         tokenizer=WordTokenizer().fit(["a b"])).eval()
    generator = torch.Generator().manual_seed(0)
    images = random_features(37, 6, 16, ImageFeatures, generator)
    texts = random_features(53, 9, 16, TextFeatures, generator)
    whole = model.similarity(images, texts)
    # 0.05 MB: blocks of a few pairs only; the tokens of a block are cut to its longest item.
    bi, bt = block_sizes(37, 53, 6, 9, block_images=8, max_block_mb=0.05)
    assert 6 * 4 * bi * bt * 6 * 9 <= 0.05 * 2**20 and (bi, bt) != (37, 53)
    sharded = score_gallery(model, images, texts, block_images=8, max_block_mb=0.05,
                            progress=False)
    torch.testing.assert_close(sharded, whole, atol=1e-6, rtol=0)


def test_scan_trains_with_constraints_and_ensemble_is_the_mean(tiny_benchmark, tmp_path):
    out, _ = tiny_benchmark
    constraints = [{"type": "CCRConstraint", "weight": 1.0, "margin": 0.1},
                   {"type": "CCSConstraint", "weight": 0.5, "margin": 0.1}]
    trainer = Trainer(scan_config(out, constraints=constraints), tmp_path / "run")
    report = trainer.fit()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    train = [r for r in records if r["type"] == "train"]
    assert all(r["loss"] >= r["ccr_loss"] + r["ccs_loss"] - 1e-5 for r in train)
    assert any(r["ccr_loss"] > 0 for r in train) and all("ccs_active" in r for r in train)
    assert 0 <= report["test"]["rsum"] <= 600

    # An ensemble of two members scores the mean of their matrices.
    other = Trainer(scan_config(out, train={"epochs": 1, "progress": False, "seed": 1},
                                model={**SCAN_MODEL, "direction": "i2t", "pooling": "lse"}),
                    tmp_path / "other")
    other.fit()
    transform = build_transforms(None, 32)
    shards = str(out / "test-{000000..000001}.tar")
    members = [Member(trainer.model, transform, trainer.tokenizer),
               Member(other.model, transform, other.tokenizer)]
    reader = EvalReader(shards, batch_size=16)
    mean, gallery = gallery_similarity(members, reader, progress=False)
    singles = [gallery_similarity([m], reader, progress=False)[0]
               for m in members]
    torch.testing.assert_close(mean, (singles[0] + singles[1]) / 2)
    assert retrieval_metrics(mean, gallery.text_to_image)["rsum"] >= 0

    # Attention metrics against the scenes' true boxes: every phrase has its object's
    # box among the regions (IoU 1), so each is evaluated.
    gallery = encode_gallery(trainer.model, EvalReader(shards, 16), transform, trainer.tokenizer,
                             progress=False, with_annotations=True)
    attention = evaluate_attention(trainer.model, gallery, trainer.tokenizer, progress=False)
    n_phrases = sum(len(e) for e in gallery.entities)
    assert attention.phrases == n_phrases and attention.phrases_without_relevant_region == 0
    assert 0 < attention.best["f1"] <= 1
    # T_att = 0 attends every region: recall 1 and precision = relevant share.
    assert abs(attention.recall[0] - 1.0) < 1e-9


COLOURS = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0), (255, 0, 255),
           (0, 255, 255), (255, 128, 0), (128, 0, 255), (0, 128, 255), (255, 255, 255)]


def colour_embedding(colour) -> torch.Tensor:
    return F.normalize(torch.tensor(colour, dtype=torch.float32) / 255, dim=-1)


class ColourModel(torch.nn.Module):
    """Embeds an image by its mean colour and a caption by the colour it names: every
    image's own captions score 1, every other caption less (exact retrieval)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("anchor", torch.zeros(1))

    def encode_image(self, batch):
        return ImageFeatures(F.normalize(batch["images"].mean((2, 3)), dim=-1))

    def encode_text(self, tokens):
        return TextFeatures(tokens["embedding"])

    def similarity(self, images, texts):
        return images.embedding @ texts.embedding.T


def colour_tokenizer(captions):
    return {"embedding": torch.stack([colour_embedding(COLOURS[int(c.split()[1])])
                                      for c in captions])}


def to_tensor(image):
    return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255).permute(2, 0, 1)


def png(colour) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (4, 4), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def colour_sample(index, captions=None):
    captions = captions or [f"colour {index} view {k}" for k in range(2)]
    return {"__key__": f"image{index}", "png": png(COLOURS[index]),
            "json": json.dumps({"image_id": index, "captions": captions}).encode()}


def test_a_repeated_image_is_evaluated_once_with_the_captions_of_its_copies(tmp_path, caplog):
    # 10 images; the second shard repeats 9 (same batch), 2 (an earlier batch) and 7 with
    # one new caption (a batch of copies only), as a resumed conversion with another
    # --shard-size leaves them.
    with ShardWriter(tmp_path, "test", max_count=6) as writer:
        for index in range(10):
            writer.write(colour_sample(index))
        writer.write({**colour_sample(9), "__key__": "copy9"})
        writer.write({**colour_sample(2), "__key__": "copy2"})
        writer.write({**colour_sample(7, ["colour 7 view 0", "colour 7 view 9"]),
                      "__key__": "copy7"})
    shards = str(tmp_path / "test-*.tar")
    model = ColourModel()
    with caplog.at_level("WARNING", logger="mmgoal.evaluation.gallery"):
        gallery = encode_gallery(model, EvalReader(shards, batch_size=4), to_tensor,
                                 colour_tokenizer, progress=False)
    assert gallery.image_ids == list(range(10)) and gallery.duplicates == 3
    assert "3 samples repeat an image id" in caplog.text
    assert len(gallery.images.embedding) == 10 and len(gallery.captions) == 21
    assert gallery.captions[-1] == "colour 7 view 9" and gallery.text_to_image[-1] == 7
    assert gallery.text_to_image.tolist() == [i for i in range(10) for _ in range(2)] + [7]
    # decoded by 2 DataLoader workers while the model encodes: the same gallery
    decoded_aside = encode_gallery(model, EvalReader(shards, batch_size=4, num_workers=2),
                                   to_tensor, colour_tokenizer, progress=False)
    assert decoded_aside.image_ids == gallery.image_ids
    assert decoded_aside.captions == gallery.captions
    assert torch.equal(decoded_aside.images.embedding, gallery.images.embedding)
    assert torch.equal(decoded_aside.text_to_image, gallery.text_to_image)
    sims = score_gallery(model, gallery.images, gallery.texts, progress=False)
    metrics = retrieval_metrics(sims, gallery.text_to_image)
    assert metrics["i2t_r1"] == metrics["t2i_r1"] == 100
    # COCO 1K style: 5 folds of 2 consecutive images, the copies' captions in their fold
    five = evaluate_retrieval(model, EvalReader(shards, batch_size=4), to_tensor,
                              colour_tokenizer, folds=5, progress=False)
    assert five["rsum"] == 600 and five["skipped"] == 0


def test_the_progress_bars_count_images_and_captions(tmp_path, monkeypatch):
    """The captions' bar has their number for total; the images' counts images (shards do
    not say how many they hold unread), never batches."""
    from tqdm import tqdm

    import mmgoal.console as console

    bars = []

    class RecordedBar(tqdm):
        def __init__(self, *args, **kwargs):  # drawn, though no terminal is there
            super().__init__(*args, **{**kwargs, "disable": False})
            bars.append(self)

    monkeypatch.setattr(console, "tqdm", RecordedBar)
    with ShardWriter(tmp_path, "test", max_count=4) as writer:
        for index in range(7):
            writer.write(colour_sample(index))
    encode_gallery(ColourModel(), EvalReader(str(tmp_path / "test-*.tar"), batch_size=3),
                   to_tensor, colour_tokenizer, progress=True)
    assert [(bar.desc, bar.unit, bar.total, bar.n) for bar in bars] == [
        ("encode images", "image", None, 7), ("encode texts", "caption", 14, 14)]
