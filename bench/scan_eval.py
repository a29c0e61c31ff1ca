"""SCAN gallery scoring: mmgoal's sharded scorer against the reference algorithm.

    python bench/scan_eval.py                      # 1000 images x 5000 captions
    python bench/scan_eval.py --images 200 --captions 1000 --reference-captions 100

Features: ``--images`` x 36 regions and ``--captions`` x 12 words, 1024-d,
L2-normalised, random. Both sides compute SCAN t2i (lambda_softmax 9, AVG).

- Baseline, "reference": the algorithm of the official SCAN evaluation code
  (``shard_xattn_t2i``): a Python loop over captions; each caption is repeated
  against a shard of 128 images, attention by ``bmm``, the attended region
  vectors by a second ``bmm``, then cosines and the mean over words. It is run
  on the first ``--reference-captions`` captions and extrapolated linearly to
  all of them (its cost is the same for every caption), which the output says.
- mmgoal: ``score_gallery`` over ``SCAN.similarity`` blocks (one large matrix
  product per block, relevance from the key Gram matrices, in place), with
  exact float32 products (``matmul_precision: highest``, the default) and with
  bfloat16 products (``medium``).

Prints both times, the ratios, the largest difference on the shared captions,
and GFLOP/s: the model FLOPs of the query-key product (2 n_t W n_i R D) per
second, next to this machine's ``torch.mm`` rate on a large square product.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from mmgoal.evaluation.gallery import score_gallery
from mmgoal.models.layers.cross_attention import scan_similarity
from mmgoal.structures import ImageFeatures, TextFeatures


class _Scorer(torch.nn.Module):
    """The SCAN similarity alone (what ``score_gallery`` calls on each block)."""

    def similarity(self, images: ImageFeatures, texts: TextFeatures) -> torch.Tensor:
        return scan_similarity(images.tokens, images.mask, texts.tokens, texts.mask, "t2i", 9.0)


def _l2norm(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x / (x.pow(2).sum(dim=dim, keepdim=True).sqrt() + 1e-8)


def _func_attention(query: torch.Tensor, context: torch.Tensor,
                    smooth: float) -> torch.Tensor:
    """The official ``func_attention`` step by step: attended context (b, W, D)."""
    batch, query_len = query.shape[:2]
    source_len = context.shape[1]
    attn = torch.bmm(context, query.transpose(1, 2))  # (b, R, W)
    attn = _l2norm(F.leaky_relu(attn, 0.1), 2)  # clipped L2 norm over the words
    attn = attn.transpose(1, 2).contiguous().view(batch * query_len, source_len)
    attn = torch.softmax(attn * smooth, dim=1).view(batch, query_len, source_len)
    attn_t = attn.transpose(1, 2).contiguous()
    weighted = torch.bmm(context.transpose(1, 2), attn_t)  # (b, D, W)
    return weighted.transpose(1, 2)


def reference_t2i(regions: torch.Tensor, words: torch.Tensor, shard: int = 128,
                  lambda_softmax: float = 9.0) -> torch.Tensor:
    """The official evaluation's algorithm (``shard_xattn_t2i`` + ``xattn_score_t2i``):
    128 x 128 shards, and inside each a loop over its captions, each repeated
    against the shard's images (full-length items)."""
    n_images = len(regions)
    sims = torch.empty(n_images, len(words))
    for image_start in range(0, n_images, shard):
        images = regions[image_start:image_start + shard]
        for text_start in range(0, len(words), shard):
            for t in range(text_start, min(text_start + shard, len(words))):
                caption = words[t][None].contiguous().repeat(len(images), 1, 1)
                attended = _func_attention(caption, images, lambda_softmax).contiguous()
                row = F.cosine_similarity(caption.contiguous(), attended, dim=2).mean(1)
                sims[image_start:image_start + shard, t] = row
    return sims


def mm_rate(size: int = 4096, repeats: int = 3) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--captions", type=int, default=5000)
    parser.add_argument("--regions", type=int, default=36)
    parser.add_argument("--words", type=int, default=12)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--reference-captions", type=int, default=250,
                        help="captions the reference scores (then extrapolated)")
    parser.add_argument("--block-images", type=int, default=128)
    parser.add_argument("--max-block-mb", type=float, default=512)
    args = parser.parse_args()
    torch.manual_seed(0)
    regions = F.normalize(torch.randn(args.images, args.regions, args.dim), dim=-1)
    words = F.normalize(torch.randn(args.captions, args.words, args.dim), dim=-1)
    images = ImageFeatures(regions.mean(1), tokens=regions,
                           mask=torch.ones(args.images, args.regions, dtype=torch.bool))
    texts = TextFeatures(words.mean(1), tokens=words,
                         mask=torch.ones(args.captions, args.words, dtype=torch.bool))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; gallery "
          f"{args.images} images x {args.captions} captions, {args.regions} regions, "
          f"{args.words} words, {args.dim}-d")
    rate = mm_rate()
    print(f"torch.mm 4096^2: {rate:.1f} GFLOP/s")

    subset = min(args.reference_captions, args.captions)
    start = time.perf_counter()
    reference = reference_t2i(regions, words[:subset])
    ref_subset = time.perf_counter() - start
    ref_total = ref_subset * args.captions / subset
    note = "" if subset == args.captions else \
        f" (measured on {subset} captions: {ref_subset:.1f} s, extrapolated linearly)"
    print(f"reference (caption loop x 128-image shards): {ref_total:.1f} s{note}")

    flops = 2 * args.captions * args.words * args.images * args.regions * args.dim
    for precision in ("highest", "medium"):
        start = time.perf_counter()
        sims = score_gallery(_Scorer(), images, texts, args.block_images, args.max_block_mb,
                             progress=False, matmul_precision=precision)
        ours = time.perf_counter() - start
        diff = (sims[:, :subset] - reference).abs().max().item()
        print(f"mmgoal score_gallery, matmul_precision {precision} (block {args.block_images} "
              f"images, {args.max_block_mb:g} MB): {ours:.1f} s, {flops / ours / 1e9:.1f} "
              f"GFLOP/s of the query-key product ({flops / ours / 1e9 / rate:.0%} of float32 "
              f"torch.mm); max |mmgoal - reference| {diff:.1e}; "
              f"ratio reference / mmgoal: {ref_total / ours:.1f}x")


if __name__ == "__main__":
    main()
