"""On a CUDA GPU: every model family trains in fp32, bf16 and fp16, and the objectives and
evaluation give what they give on the CPU.

Marked ``gpu`` and skipped without CUDA; ``bench/gpu_check.py`` runs them on a GPU
machine (docs/results/gpu.md).
"""

import itertools

import pytest
import torch
import torch.nn.functional as F

from mmgoal.data.tokenizers import WordTokenizer
from mmgoal.devices import autocast, move_to_device
from mmgoal.evaluation.gallery import score_gallery
from mmgoal.evaluation.rerank import itm_rerank
from mmgoal.evaluation.retrieval import retrieval_metrics
from mmgoal.objectives.mining import positives_from_groups
from mmgoal.registry import MODELS, OBJECTIVES
from mmgoal.structures import ImageFeatures, ObjectiveInputs, TextFeatures

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CAPTIONS = ["a red circle", "a blue square", "a star left of a circle", "a red star",
            "a green cross above a square", "two circles"]
GRU = {"type": "GRUTextEncoder", "word_dim": 8, "hidden_size": 16, "bidirectional": True}
FAMILIES = {
    "DualEncoder": {"type": "DualEncoder", "embed_dim": 16,
                    "image_encoder": {"type": "TimmImageEncoder",
                                      "model_name": "mmgoal_small_cnn",
                                      "model_kwargs": {"widths": [8, 16]}},
                    "text_encoder": {**GRU, "pooling": "mean"}},
    "VSEInfinity": {"type": "DualEncoder", "embed_dim": 16,
                    "image_encoder": {"type": "PrecomputedRegionEncoder", "feature_dim": 12,
                                      "token_dropout": 0.2},
                    "image_pooler": {"type": "GPO", "d_pe": 8, "d_hidden": 8},
                    "text_encoder": GRU, "text_pooler": {"type": "GPO", "d_pe": 8,
                                                         "d_hidden": 8},
                    "image_projection": "mlp"},
    "SCAN": {"type": "SCAN", "embed_dim": 16, "text_encoder": GRU,
             "image_encoder": {"type": "PrecomputedRegionEncoder", "feature_dim": 12}},
    "XVLM": {"type": "XVLM", "fusion_layers": 1, "embed_dim": 16,
             "vision": {"model_name": "vit_tiny_patch16_224",
                        "model_kwargs": {"img_size": 32, "patch_size": 8, "embed_dim": 32,
                                         "depth": 2, "num_heads": 2}},
             "text": {"config": {"model_type": "bert", "hidden_size": 32,
                                 "num_hidden_layers": 2, "num_attention_heads": 2,
                                 "intermediate_size": 32, "max_position_embeddings": 32}}},
}
CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def exact_float32():
    """TF32 off: the CPU comparisons below are at float32's precision."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(previous)


def tokenizer() -> WordTokenizer:
    return WordTokenizer().fit(CAPTIONS)


def training_batch(tok: WordTokenizer, n: int = 6) -> dict:
    torch.manual_seed(0)
    return {"images": torch.randn(n, 3, 32, 32), "regions": torch.randn(n, 5, 12),
            "region_lengths": torch.tensor([5, 3, 4, 5, 2, 5][:n]),
            "image_groups": torch.arange(n), **tok(CAPTIONS[:n])}


@pytest.mark.parametrize("family,precision",
                         list(itertools.product(FAMILIES, ("fp32", "bf16", "fp16"))))
def test_every_model_family_trains_on_cuda(family, precision):
    tok = tokenizer()
    torch.manual_seed(0)
    model = MODELS.build(FAMILIES[family], tokenizer=tok).to(CUDA).train()
    objective = OBJECTIVES.build({"type": "GoalObjective", "triplet": "cir", "pair": "sig_ms"})
    batch = move_to_device(training_batch(tok), CUDA)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**8, enabled=precision == "fp16")
    with autocast(CUDA, precision):
        images, texts = model.encode_image(batch), model.encode_text(batch)
        sims = model.similarity(images, texts)
        positives = positives_from_groups(batch["image_groups"])
        loss = objective(ObjectiveInputs(sims, positives))["goal_loss"]
    assert sims.is_cuda and torch.isfinite(sims).all()
    if family != "SCAN" and precision != "fp32":  # a plain product of embeddings
        assert sims.dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    scaler.scale(loss).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(g.is_cuda and torch.isfinite(g).all() for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 0


def random_scores(n: int = 48) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    images, texts = F.normalize(torch.randn(n, 16), dim=-1), F.normalize(torch.randn(n, 16),
                                                                          dim=-1)
    groups = torch.arange(n) // 2  # two captions per image id: several positives per row
    return images @ texts.T, positives_from_groups(groups)


@pytest.mark.parametrize("triplet,pair", list(itertools.product(("con", "nca", "cir"),
                                                           ("con", "lin", "sig", "lin_ms",
                                                            "sig_ms"))))
def test_goal_gradients_on_cuda_equal_the_cpu(triplet, pair):
    objective = OBJECTIVES.build({"type": "GoalObjective", "triplet": triplet, "pair": pair})
    sims, positives = random_scores()
    results = []
    for device in ("cpu", "cuda"):
        scores = sims.to(device).requires_grad_()
        out = objective(ObjectiveInputs(scores, positives.to(device)))
        out["goal_loss"].backward()
        results.append((out["goal_loss"].detach().cpu(), scores.grad.cpu()))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-5, atol=1e-5)


def test_scan_scoring_and_retrieval_metrics_on_cuda_equal_the_cpu():
    tok = tokenizer()
    torch.manual_seed(0)
    model = MODELS.build(FAMILIES["SCAN"], tokenizer=tok).eval()
    regions = F.normalize(torch.randn(30, 7, 16), dim=-1)
    words = F.normalize(torch.randn(90, 5, 16), dim=-1)
    region_mask = torch.rand(30, 7) > 0.2
    word_mask = torch.rand(90, 5) > 0.2
    region_mask[:, 0] = word_mask[:, 0] = True
    images = ImageFeatures(regions.mean(1), tokens=regions, mask=region_mask)
    texts = TextFeatures(words.mean(1), tokens=words, mask=word_mask)
    text_to_image = torch.arange(90) // 3
    cpu = score_gallery(model, images, texts, block_images=8, max_block_mb=0.05, progress=False)
    gpu = score_gallery(model.to(CUDA), move_to_device(images, CUDA),
                        move_to_device(texts, CUDA), block_images=8, max_block_mb=0.05,
                        progress=False)
    assert gpu.is_cuda
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-5, atol=1e-5)
    # the same score matrix ranked on either device: the same metrics
    assert retrieval_metrics(cpu.to(CUDA), text_to_image.to(CUDA), folds=5) == \
        retrieval_metrics(cpu, text_to_image, folds=5)
    automatic = score_gallery(model, move_to_device(images, CUDA), move_to_device(texts, CUDA),
                              progress=False)  # blocks sized from free GPU memory
    torch.testing.assert_close(automatic, gpu)


def test_itm_reranking_on_cuda_equals_the_cpu():
    tok = tokenizer()
    torch.manual_seed(0)
    model = MODELS.build(FAMILIES["XVLM"], tokenizer=tok).eval()
    batch = training_batch(tok)
    with torch.no_grad():
        images, texts = model.encode_image(batch), model.encode_text(batch)
        itc = model.similarity(images, texts)
    cpu = itm_rerank(model, images, texts, itc, k=3, batch_size=4, progress=False)
    gpu = itm_rerank(model.to(CUDA), move_to_device(images, CUDA), move_to_device(texts, CUDA),
                     itc.to(CUDA), k=3, batch_size=4, progress=False)
    for on_gpu, on_cpu in zip(gpu, cpu):
        assert on_gpu.is_cuda
        torch.testing.assert_close(on_gpu.cpu(), on_cpu, rtol=1e-5, atol=1e-5)
