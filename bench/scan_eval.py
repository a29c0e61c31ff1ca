"""SCAN gallery scoring: mmgoal's sharded scorer against the reference algorithm.

    python bench/scan_eval.py                      # 1000 images x 5000 captions
    python bench/scan_eval.py --images 200 --captions 1000 --reference-captions 100
    python bench/scan_eval.py --compile            # eager scorer vs torch.compile, no reference

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

``--compile`` measures instead whether ``torch.compile`` of SCAN's elementwise
part pays on this gallery. Baseline, "eager": ``score_gallery`` as above
(float32). Against it, on the same blocks and work arrays:

- "products only": the query-key product, the Gram matrices and the Gram
  product of every block and nothing else, the floor of any scorer that
  compiles only the elementwise part (eager minus this is all it can save);
- "compiled": the same products, with the elementwise steps between them
  (LeakyReLU, clipped L2 norm, lambda, the unnormalised softmax's exp) and
  after them (the two weighted sums over the keys, the cosine, the mean over
  words) each one ``torch.compile`` d function (inductor; C++ through gcc on a
  CPU); then with only the step after the Gram product compiled. A compiled
  scorer's first pass over the gallery compiles (every block shape; the
  inductor cache is a fresh empty folder, as on a first run) and its second
  runs compiled code only; the compile time is the difference (the first
  compiled scorer's includes inductor's one-time start-up in the process).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.nn.functional as F

from mmgoal.evaluation.gallery import block_budget_mb, score_gallery
from mmgoal.models.layers.cross_attention import EPS, scan_similarity
from mmgoal.structures import ImageFeatures, TextFeatures, slice_features


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


def _attention_weights(raw: torch.Tensor, query_mask: torch.Tensor, key_mask: torch.Tensor,
                       out: torch.Tensor, lambda_softmax: float) -> None:
    """The elementwise steps between the products, into ``out``: LeakyReLU, clipped L2
    norm over the queries, lambda, the unnormalised softmax (as the eager in-place path)."""
    scores = F.leaky_relu(raw, 0.1) * query_mask
    logits = scores * (lambda_softmax / (scores.norm(dim=-1, keepdim=True) + EPS))
    out.copy_(logits.masked_fill(~key_mask[:, :, None, None], float("-inf")).exp())


def _attention_weights_in_place(raw: torch.Tensor, query_mask: torch.Tensor,
                                key_mask: torch.Tensor, out: torch.Tensor,
                                lambda_softmax: float) -> None:
    """:func:`_attention_weights` step by step in place, as the eager scorer runs it."""
    weights = torch.ops.aten.leaky_relu.out(raw, 0.1, out=out).mul_(query_mask)
    weights.mul_(weights.norm(dim=-1, keepdim=True).add_(EPS).reciprocal_()
                 .mul_(lambda_softmax))
    weights.masked_fill_(~key_mask[:, :, None, None], float("-inf")).exp_()


def _relevance_avg(raw: torch.Tensor, attention: torch.Tensor, quad: torch.Tensor,
                   query_norm: torch.Tensor, query_mask: torch.Tensor) -> torch.Tensor:
    """The elementwise steps after the Gram product: the weighted sums over the keys,
    the cosine of each query with its attended vector, the mean over the real words."""
    dot = (raw * attention).sum(1)
    norm = (quad * attention).sum(1).clamp(min=EPS**2).sqrt()
    relevance = dot / (query_norm * norm).clamp(min=EPS)
    return (relevance * query_mask).sum(-1) / query_mask.sum(-1).clamp(min=1)


class _SplitScorer(torch.nn.Module):
    """SCAN t2i AVG with the products eager and the elementwise steps before the Gram
    product (``weights``) and after it (``relevance``) ``torch.compile`` d where asked,
    or skipped (``products_only``: the products' time alone). Its work arrays are reused
    from block to block, as ``score_gallery``'s eager scorer does."""

    def __init__(self, compile_weights: bool = True, compile_relevance: bool = True,
                 products_only: bool = False) -> None:
        super().__init__()
        self.products_only = products_only
        self.weights = torch.compile(_attention_weights) if compile_weights else \
            _attention_weights_in_place
        self.relevance = torch.compile(_relevance_avg) if compile_relevance else _relevance_avg
        self.work: dict[str, torch.Tensor] = {}

    def _buffer(self, name: str, numel: int) -> torch.Tensor:
        if name not in self.work or self.work[name].numel() < numel:
            self.work[name] = torch.empty(numel)
        return self.work[name][:numel]

    def similarity(self, images: ImageFeatures, texts: TextFeatures) -> torch.Tensor:
        keys, queries = images.tokens, texts.tokens
        (n_k, k_len, dim), (n_q, q_len, _) = keys.shape, queries.shape
        shape = (n_k, k_len, n_q, q_len)
        size = n_k * k_len * n_q * q_len
        raw = torch.mm(keys.reshape(-1, dim), queries.reshape(-1, dim).T,
                       out=self._buffer("raw", size).view(n_k * k_len, -1)).view(shape)
        gram = keys @ keys.transpose(1, 2)
        attention = self._buffer("attention", size).view(shape)
        if not self.products_only:
            self.weights(raw, texts.mask, images.mask, attention, 9.0)
        quad = torch.bmm(gram, attention.view(n_k, k_len, -1),
                         out=self._buffer("quad", size).view(n_k, k_len, -1)).view(shape)
        if self.products_only:
            return raw[:, 0, :, 0]
        return self.relevance(raw, attention, quad, queries.norm(dim=-1)[None], texts.mask)


def compare_compiled(images: ImageFeatures, texts: TextFeatures, block_images: int,
                     max_block_mb: float) -> None:
    """Eager ``score_gallery`` (the baseline) against its products alone and against the
    elementwise steps compiled: compile + first pass, then a compiled pass."""
    def timed(scorer: torch.nn.Module) -> tuple[torch.Tensor, float]:
        start = time.perf_counter()
        sims = score_gallery(scorer, images, texts, block_images, max_block_mb, progress=False)
        return sims, time.perf_counter() - start

    # warm-up on a corner of the gallery (first allocations, oneDNN's kernels)
    score_gallery(_Scorer(), slice_features(images, 0, block_images),
                  slice_features(texts, 0, 500), block_images, max_block_mb, progress=False)
    eager_sims, eager = timed(_Scorer())
    print(f"eager score_gallery (baseline): {eager:.1f} s", flush=True)
    _, products = timed(_SplitScorer(False, False, products_only=True))
    print(f"products only (query-key, Gram; no elementwise step): {products:.1f} s, "
          f"ratio eager / products only: {eager / products:.2f}x; the elementwise steps "
          f"take {eager - products:.1f} s of the eager run")
    variants = {"both elementwise steps": (True, True),
                "the step after the Gram product only": (False, True)}
    for name, parts in variants.items():
        torch._dynamo.reset()
        with tempfile.TemporaryDirectory(prefix="inductor_cache_") as cache:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # a cold compile, as on a first run
            scorer = _SplitScorer(*parts)
            _, first = timed(scorer)
            sims, run = timed(scorer)
        print(f"compiled, {name}: compile {first - run:.1f} s (first pass {first:.1f} s), "
              f"compiled run {run:.1f} s, max |compiled - eager| "
              f"{(sims - eager_sims).abs().max().item():.1e}; ratio eager / (compile + run) "
              f"{eager / first:.2f}x, ratio eager / compiled run {eager / run:.2f}x",
              flush=True)


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
    parser.add_argument("--max-block-mb", type=float, default=None,
                        help="a block's working set (default: mmgoal's, the process's share "
                             "of the CPU's last-level cache)")
    parser.add_argument("--compile", action="store_true",
                        help="eager scorer vs torch.compile of its elementwise steps "
                             "(no reference run)")
    args = parser.parse_args()
    args.max_block_mb = block_budget_mb(torch.device("cpu"), args.max_block_mb)
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
    if args.compile:
        compare_compiled(images, texts, args.block_images, args.max_block_mb)
        return
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
