"""bench/eval.py and bench/scan_eval.py --compile measure what they say, on tiny inputs
(their timings are not checked: wall-clock times are never asserted)."""

import pytest
import torch
import torch.nn.functional as F
from script_modules import load_script

from mmgoal.models.layers.cross_attention import scan_similarity
from mmgoal.structures import ImageFeatures, TextFeatures


@pytest.mark.slow
@pytest.mark.parametrize("name", ["quickstart", "scan"])
def test_eval_bench_measures_a_gallery_through_encode_gallery(tiny_benchmark, name):
    bench = load_script("bench/eval.py")
    out, summary = tiny_benchmark
    shards = str(out / summary["splits"]["test"]["pattern"])
    result = bench.measure(name, shards, batch_size=16, repeats=2,
                           workers=2 if name == "quickstart" else 0)
    assert (result["images"], result["captions"]) == (40, 200)
    assert all(s > 0 for side in result["seconds"].values() for s in side)
    if name == "quickstart":  # one 512-d float32 embedding per item
        assert result["image_bytes"] == {"embedding": 40 * 512 * 4}
        assert result["text_bytes"] == {"embedding": 200 * 512 * 4}
    else:  # regions x 256 and words x 256 float32, with their masks
        regions = result["image_shapes"]["tokens"][1]
        assert result["image_shapes"]["tokens"] == [40, regions, 256]
        assert result["image_bytes"]["tokens"] == 40 * regions * 256 * 4
        assert result["image_bytes"]["mask"] == 40 * regions
        assert 0 < result["text_padding"] < 1


def test_the_split_scorer_of_scan_eval_scores_as_scan_similarity():
    """The products-and-elementwise-steps scorer that ``--compile`` compiles (here run
    eagerly), against the model's scorer, with padded regions and words."""
    bench = load_script("bench/scan_eval.py")
    torch.manual_seed(0)
    regions = F.normalize(torch.randn(6, 5, 16), dim=-1)
    words = F.normalize(torch.randn(7, 4, 16), dim=-1)
    region_mask = torch.arange(5) < torch.tensor([5, 3, 4, 5, 2, 1])[:, None]
    word_mask = torch.arange(4) < torch.tensor([4, 2, 3, 1, 4, 4, 2])[:, None]
    regions, words = regions * region_mask[..., None], words * word_mask[..., None]
    images = ImageFeatures(regions.mean(1), tokens=regions, mask=region_mask)
    texts = TextFeatures(words.mean(1), tokens=words, mask=word_mask)
    expected = scan_similarity(regions, region_mask, words, word_mask, "t2i", 9.0)
    scores = bench._SplitScorer(compile_weights=False, compile_relevance=False) \
        .similarity(images, texts)
    torch.testing.assert_close(scores, expected, atol=1e-6, rtol=1e-5)
