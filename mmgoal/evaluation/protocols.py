"""The extended COCO 5K test protocols of ``evaluation.protocols``: ECCV Caption (Chun et
al., ECCV 2022), CxC (Parekh et al., EACL 2021), PM-COCO (Chun et al., CVPR 2021); what
they need and how they are computed and checked: docs/reference/retrieval.md, "COCO
protocols". Ties count against the query: a positive tied with a negative ranks below it.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mmgoal.data.coco import package_data_dir
from mmgoal.files import MAX_ANNOTATION_BYTES, check_regular, read_text
from mmgoal.runs.schema import PROTOCOLS, ScoringConfig

__all__ = ["PROTOCOLS", "protocol_metrics", "protocol_rankings", "load_reference"]

logger = logging.getLogger(__name__)

RECALL_KS = (1, 5, 10)
# protocol -> the metrics it reports (names of :func:`ranking_metrics`)
METRICS = {"eccv": ("map_at_r", "rprecision", "r1"), "cxc": ("r1", "r5", "r10"),
           "pm": ("rprecision",)}
PM_FILES = ("pm_image_to_caption.json", "pm_caption_to_image.json")
_BLOCK_MB = 64  # the queries x items scores of one block of queries


@dataclass(frozen=True)
class CocoReference:
    """COCO 5K test by COCO ids (captions in ``coco_test_ids.npy``'s order), each caption's
    image (COCO's label), and ``positives``: protocol -> direction -> query id -> item ids."""

    image_ids: tuple[int, ...]
    caption_ids: tuple[int, ...]
    caption_image: dict[int, int]
    positives: dict[str, dict[str, dict[int, list[int]]]]


def _read_positives(i2t: Path, t2i: Path) -> dict[str, dict[int, list[int]]]:
    out = {}
    for direction, path in (("i2t", i2t), ("t2i", t2i)):
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist (the positives of a COCO protocol)")
        out[direction] = {int(query): [int(item) for item in items]
                          for query, items in json.loads(read_text(
                              path, "ECCV Caption positives file", MAX_ANNOTATION_BYTES)).items()}
    return out


@functools.lru_cache(maxsize=2)
def load_reference(protocols: tuple[str, ...], pm_dir: str | None = None) -> CocoReference:
    """The test ids, COCO's labels and the positives of ``protocols`` (``eccv``, ``cxc``:
    eccv_caption's files; ``pm``: ``pm_dir``'s)."""
    data = package_data_dir()
    original = _read_positives(data / "original_image_to_caption.json",
                               data / "original_caption_to_image.json")
    positives = {}
    for protocol in protocols:
        if protocol == "pm":
            files = [Path(pm_dir) / name for name in PM_FILES]
            absent = [f.name for f in files if not f.is_file()]
            if absent:
                raise FileNotFoundError(f"evaluation.pm_dir {pm_dir} lacks {', '.join(absent)}:"
                                        f" download PM-COCO's files there (https://github.com/"
                                        f"naver-ai/eccv-caption, 'Download the full data')")
            positives["pm"] = _read_positives(*files)
        elif protocol in METRICS:
            positives[protocol] = _read_positives(data / f"{protocol}_image_to_caption.json",
                                                  data / f"{protocol}_caption_to_image.json")
    check_regular(data / "coco_test_ids.npy", "ECCV Caption id file")
    captions = tuple(int(c) for c in np.load(data / "coco_test_ids.npy", allow_pickle=False))
    caption_image = {caption: images[0] for caption, images in original["t2i"].items()}
    return CocoReference(tuple(original["i2t"]), captions, caption_image, positives)


def _coco_id(value) -> int | None:
    """A COCO id (an int, or a string of digits: precomputed features' ids files)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None


def _examples(values) -> str:
    return ", ".join(map(str, list(values)[:5]))


def gallery_positions(reference: CocoReference, image_ids: Sequence, caption_ids: Sequence,
                      text_to_image: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(image_rows, caption_columns)`` of the test images and captions in the gallery, in
    the reference's order; a ``ValueError`` saying what differs unless the gallery is COCO
    5K test exactly (extra captions of test images are left out)."""
    need = "the COCO protocols eccv, cxc and pm (evaluation.protocols)"
    remake = ("make the shards with mmgoal make-shards karpathy --json dataset_coco.json "
              "--image-root DIR --out DIR --coco-captions captions_val2014.json (docs/data.md, "
              "'COCO ids')")
    images = [_coco_id(i) for i in image_ids]
    problems = []
    not_coco = [i for i, c in zip(image_ids, images) if c is None]
    known = set(reference.image_ids)
    missing = known.difference(images)
    foreign = [i for i in images if i is not None and i not in known]
    if not_coco:
        problems.append(f"{len(not_coco)} of its {len(images)} image ids are no COCO ids "
                        f"(e.g. {_examples(not_coco)})")
    if missing or foreign:
        problems.append(f"it is not the COCO 5K test split (Karpathy's): it lacks "
                        f"{len(missing)} of the 5,000 test images"
                        + (f" (e.g. {_examples(sorted(missing))})" if missing else "")
                        + f" and holds {len(foreign)} others"
                        + (f" (e.g. {_examples(foreign)})" if foreign else ""))
    if all(c is None for c in caption_ids):
        problems.append("its captions have no COCO caption ids")
    if problems:
        raise ValueError(f"{need} score COCO 5K test by COCO image and caption ids, and this "
                         f"gallery of {len(images)} images and {len(caption_ids)} captions "
                         f"cannot be scored: {'; '.join(problems)}. Evaluate the COCO test "
                         f"split made with COCO ids ({remake}), or leave these protocols out "
                         f"(--protocols coco)")
    row_of = {image: row for row, image in enumerate(images)}
    column_of = {}
    for column, caption in enumerate(caption_ids):
        if caption is not None:
            column_of.setdefault(caption, column)
    absent = [c for c in reference.caption_ids if c not in column_of]
    if absent:
        raise ValueError(f"{need} need every one of the 25,000 test captions, and "
                         f"{len(absent)} of them are not in the gallery (e.g. caption ids "
                         f"{_examples(absent)}); shards whose captions matched no annotation "
                         f"have null ids there: {remake}")
    wrong = [c for c in reference.caption_ids
             if images[text_to_image[column_of[c]]] != reference.caption_image[c]]
    if wrong:
        raise ValueError(f"{len(wrong)} captions are in the gallery under another image than "
                         f"COCO's (e.g. caption {wrong[0]} under image "
                         f"{images[text_to_image[column_of[wrong[0]]]]}, COCO says "
                         f"{reference.caption_image[wrong[0]]}); the shards' caption ids do not "
                         f"fit their images: {remake}")
    extra = len(caption_ids) - len(reference.caption_ids)
    if extra:
        logger.info("%d of the gallery's captions are not among COCO 5K test's 25,000 "
                    "(e.g. Karpathy's sixth captions): the COCO protocols leave them out",
                    extra)
    return (torch.tensor([row_of[i] for i in reference.image_ids], device="cpu"),
            torch.tensor([column_of[c] for c in reference.caption_ids], device="cpu"))


def ranked_hits(scores: torch.Tensor, queries: torch.Tensor, positives: Sequence[Sequence[int]],
                k: int, by_columns: bool = False, excluded: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(top, hits)``, (len(queries), k) on the CPU: the queries' top ``k`` items, best
    first, and whether each is a positive. ``scores``: a query a row (``by_columns``: a
    column), not copied; ``excluded``: items no query ranks.
    """
    n_items = scores.shape[0 if by_columns else 1]
    k = min(k, n_items)
    block = max(1, min(len(queries), int(_BLOCK_MB * 2**20 // (4 * n_items))))
    buffer = scores.new_empty((block, n_items), dtype=torch.float32)
    order = queries.sort().indices  # in gallery order: the gathers read ahead
    tops = torch.empty((len(queries), k), dtype=torch.long, device="cpu")
    hits = torch.empty((len(queries), k), dtype=torch.bool, device="cpu")
    for start in range(0, len(queries), block):
        chosen = order[start:start + block]
        rows = queries[chosen].to(scores.device)
        view = buffer[:len(chosen)]
        if by_columns:
            view.copy_(scores.index_select(1, rows).T)
        elif scores.dtype == view.dtype:  # straight into the buffer
            torch.index_select(scores, 0, rows, out=view)
        else:
            view.copy_(scores.index_select(0, rows))
        if excluded is not None and len(excluded):
            view.index_fill_(1, excluded.to(view.device), -torch.inf)
        mask = torch.zeros(view.shape, dtype=torch.bool, device=view.device)
        wanted = [positives[q] for q in chosen.tolist()]
        at = (torch.tensor([r for r, items in enumerate(wanted) for _ in items],
                           dtype=torch.long, device=view.device),
              torch.tensor([i for items in wanted for i in items], dtype=torch.long,
                           device=view.device))
        if len(at[1]):
            mask[at] = True
            # just below its score: under every negative with the same score, above any lower
            view[at] = torch.nextafter(view[at], view.new_tensor(-torch.inf))
        top = view.topk(k, dim=1).indices
        tops[chosen] = top.cpu()
        hits[chosen] = mask.gather(1, top).cpu()
    return tops, hits


def ranking_metrics(hits: torch.Tensor, positives: torch.Tensor) -> dict[str, float]:
    """R@1/5/10, R-Precision and mAP@R (percent) of ranked ``hits`` (n_queries, k), ``k`` at
    least each query's ``positives`` (n_queries,) R, those outside the gallery included."""
    hits = hits.double()
    r = positives.double()
    ranks = torch.arange(1, hits.shape[1] + 1, dtype=torch.float64, device=hits.device)
    within = ranks[None, :] <= r[:, None]
    precision_at = hits.cumsum(dim=1) / ranks
    out = {f"r{k}": 100.0 * (hits[:, :k].sum(dim=1) > 0).double().mean().item()
           for k in RECALL_KS}
    out["rprecision"] = 100.0 * ((hits * within).sum(dim=1) / r).mean().item()
    out["map_at_r"] = 100.0 * ((hits * precision_at * within).sum(dim=1) / r).mean().item()
    return out


@dataclass
class _Direction:
    """One direction of retrieval on the gallery: its score matrix (queries along rows, or
    along columns), the gallery positions of the reference's queries and items, and each
    item position's COCO id."""

    scores: torch.Tensor
    by_columns: bool
    query_position: dict[int, int]  # COCO id -> the gallery's row (column)
    item_position: dict[int, int]
    item_ids: np.ndarray  # the gallery's item positions -> COCO id (-1: no test item)
    excluded: torch.Tensor


def _directions(sims: torch.Tensor, sims_t2i: torch.Tensor | None, reference: CocoReference,
                image_ids: Sequence, caption_ids: Sequence, text_to_image: Sequence[int]
                ) -> dict[str, _Direction]:
    rows, columns = gallery_positions(reference, image_ids, caption_ids,
                                      [int(i) for i in text_to_image])
    images = dict(zip(reference.image_ids, rows.tolist()))
    captions = dict(zip(reference.caption_ids, columns.tolist()))
    caption_of = np.full(sims.shape[1], -1, dtype=np.int64)
    caption_of[columns.numpy()] = reference.caption_ids
    image_of = np.full(sims.shape[0], -1, dtype=np.int64)
    image_of[rows.numpy()] = reference.image_ids
    excluded = torch.from_numpy(np.flatnonzero(caption_of < 0))
    return {"i2t": _Direction(sims, False, images, captions, caption_of, excluded),
            "t2i": _Direction(sims if sims_t2i is None else sims_t2i, True, captions, images,
                              image_of, torch.empty(0, dtype=torch.long, device="cpu"))}


def _extended(protocols: Sequence[str], pm_dir: str | None) -> tuple[str, ...]:
    extended = tuple(p for p in dict.fromkeys(protocols) if p != "coco")
    # a ValueError for a name that is no protocol, or pm without its files
    ScoringConfig(protocols=list(extended), pm_dir=pm_dir)
    return extended


def protocol_metrics(sims: torch.Tensor, image_ids: Sequence, caption_ids: Sequence,
                     text_to_image: Sequence[int], protocols: Sequence[str],
                     pm_dir: str | None = None, sims_t2i: torch.Tensor | None = None
                     ) -> dict[str, float]:
    """``{protocol}_{i2t|t2i}_{metric}`` (percent) of the extended ``protocols`` on a COCO
    5K test gallery (ids: its ``Gallery``'s); ``sims_t2i``: a separate text-to-image matrix
    (ITM re-ranking)."""
    extended = _extended(protocols, pm_dir)
    if not extended:
        return {}
    reference = load_reference(extended, pm_dir)
    directions = _directions(sims, sims_t2i, reference, image_ids, caption_ids, text_to_image)
    metrics = {}
    for protocol in extended:
        for name, direction in directions.items():
            gts = reference.positives[protocol][name]
            asked = [q for q in gts if q in direction.query_position]
            queries = torch.tensor([direction.query_position[q] for q in asked], device="cpu")
            found = [[direction.item_position[i] for i in dict.fromkeys(gts[q])
                      if i in direction.item_position] for q in asked]
            counts = torch.tensor([len(set(gts[q])) for q in asked], device="cpu")
            _, hits = ranked_hits(direction.scores, queries, found,
                                  max(int(counts.max()), max(RECALL_KS)),
                                  direction.by_columns, direction.excluded)
            values = ranking_metrics(hits, counts)
            metrics.update({f"{protocol}_{name}_{metric}": values[metric]
                            for metric in METRICS[protocol]})
    return metrics


def protocol_rankings(sims: torch.Tensor, image_ids: Sequence, caption_ids: Sequence,
                      text_to_image: Sequence[int], protocols: Sequence[str],
                      pm_dir: str | None = None, sims_t2i: torch.Tensor | None = None
                      ) -> dict[str, dict[int, list[int]]]:
    """Every test query's top items by COCO id, as eccv_caption's ``Metrics`` takes them:
    ``{"i2t": {image_id: [caption ids]}, "t2i": {caption_id: [image ids]}}``, as many as the
    ``protocols`` need (their largest number of positives, at least 10)."""
    extended = _extended(protocols, pm_dir)
    reference = load_reference(extended, pm_dir)
    out = {}
    for name, direction in _directions(sims, sims_t2i, reference, image_ids, caption_ids,
                                       text_to_image).items():
        k = max([max(RECALL_KS)] + [len(set(v)) for p in extended
                                    for v in reference.positives[p][name].values()])
        asked = list(direction.query_position)
        queries = torch.tensor([direction.query_position[q] for q in asked], device="cpu")
        top, _ = ranked_hits(direction.scores, queries, [[]] * len(asked), k,
                             direction.by_columns, direction.excluded)
        ids = direction.item_ids[top.numpy()]
        out[name] = {query: ids[i].tolist() for i, query in enumerate(asked)}
    return out
