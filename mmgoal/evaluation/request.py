"""One evaluation as a library call: what ``mmgoal eval`` and ``mmgoal wise-ft`` measure
(retrieval on a split, zero-shot classification, attention P/R/F1), asked for by an
:class:`EvaluationRequest` and answered by :func:`evaluate`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mmgoal.config import close_match_hints
from mmgoal.contract import CrossAttentionModel, require
from mmgoal.data.classification import ClassificationSet
from mmgoal.data.pipeline import EvalReader
from mmgoal.distributed import all_objects, world_info
from mmgoal.evaluation.attention import T_IOU, AttentionReport, attention_on_split
from mmgoal.evaluation.gallery import evaluate_retrieval
from mmgoal.evaluation.retrieval import RECALLS
from mmgoal.evaluation.zeroshot import ACCURACIES, evaluate_zeroshot
from mmgoal.runs.loading import LoadedModel
from mmgoal.runs.schema import ScoringConfig
from mmgoal.structures import Member


@dataclass
class AttentionRequest:
    """The attention metrics of the first member on the retrieval split.

    Attributes:
        thresholds: the ``T_att`` sweep.
        t_iou: the IoU of a relevant region.
        entities: a Flickr30K Entities folder joined to the shards by image id (``None``:
            the shards' own entity boxes).
    """

    thresholds: Sequence[float]
    t_iou: float = T_IOU
    entities: str | None = None


@dataclass
class EvaluationRequest:
    """What to evaluate.

    Attributes:
        split: the retrieval split's reader (``None``: no retrieval).
        folds: the image folds the retrieval metrics are averaged over.
        scoring: how the gallery is scored (re-ranking, blocks, protocols).
        rankings: also return every COCO test query's top items by COCO id.
        protocols: in place of ``scoring.protocols`` (validation's: ``["coco"]``).
        zeroshot: a zero-shot classification set the first member classifies.
        zeroshot_batch_size, zeroshot_workers: its images per batch, and the DataLoader
            processes that decode them.
        attention: the attention metrics of the first member on ``split``.
        across_ranks: a collective: every rank encodes and scores its share of the gallery
            and gets every metric; the zero-shot set and the attention metrics are rank 0's.
        progress: progress bars.
        stop: polled while the gallery is encoded and scored: ``True`` drops the evaluation
            (:class:`~mmgoal.evaluation.gallery.EvaluationStopped`).
    """

    split: EvalReader | None = None
    folds: int = 1
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    protocols: Sequence[str] | None = None
    rankings: bool = False
    zeroshot: ClassificationSet | None = None
    zeroshot_batch_size: int = 256
    zeroshot_workers: int = 0
    attention: AttentionRequest | None = None
    across_ranks: bool = False
    progress: bool = True
    stop: Callable[[], bool] | None = None


def request_for(loaded: LoadedModel, split: str | None, shards: str | list[str] | None = None,
                trust_data_paths: bool = False, zeroshot: ClassificationSet | None = None,
                scoring: dict | None = None, folds: int | None = None,
                **options) -> EvaluationRequest:
    """The request of a loaded run: its ``data.<split>`` (``shards`` in place of the
    config's; ``None``: no retrieval) scored by its ``evaluation`` section updated with
    ``scoring``, as :func:`config_request` makes it."""
    split_cfg = None if split is None else loaded.split(split, shards, trust_data_paths)
    return config_request(loaded.config["data"], split_cfg,
                          {**loaded.config["evaluation"], **(scoring or {})}, zeroshot, folds,
                          **options)


def check_best_metric(name: str, zeroshot: bool) -> None:
    """Refuse a ``train.best_metric`` that validation does not report, or a rank (lower is
    better), before the run trains; ``zeroshot``: validation classifies a zero-shot set."""
    higher = RECALLS + (ACCURACIES if zeroshot else ())
    if name in higher:
        return
    why = ("a rank: lower is better, and best.pt keeps the highest" if name.endswith(
        ("_medr", "_meanr")) else "not a metric validation reports" + (
        "; zero-shot accuracies need evaluation.zeroshot" if name in ACCURACIES else ""))
    raise ValueError(f"train.best_metric {close_match_hints([name], higher)} is {why}; "
                     f"choose one of {', '.join(higher)}")


def config_request(data: Mapping[str, Any], split: Mapping[str, Any] | None,
                   evaluation: ScoringConfig | Mapping[str, Any],
                   zeroshot: ClassificationSet | None = None, folds: int | None = None,
                   **options) -> EvaluationRequest:
    """The request a config makes (a run's dicts or the trainer's typed sections): its
    ``data.<split>`` section ``split`` (``None``: no retrieval) scored as ``evaluation``
    says, in ``folds`` (default: the split's), and the ``zeroshot`` set at ``data``'s
    evaluation batch size and workers; ``options``: the rest of :class:`EvaluationRequest`."""
    request = EvaluationRequest(zeroshot=zeroshot, zeroshot_batch_size=data["eval_batch_size"],
                                zeroshot_workers=data["num_workers"], **options)
    if split is not None:
        request.split = EvalReader.of_split(split, data)
        request.folds = folds or split["folds"]
        request.scoring = ScoringConfig.of(evaluation)  # checked before the gallery's minutes
    return request


@dataclass
class Evaluation:
    """What :func:`evaluate` measured.

    Attributes:
        metrics: the retrieval metrics (``skipped`` among them), then the ``zeroshot_*``.
        rankings: as :func:`~mmgoal.evaluation.protocols.protocol_rankings` fills them
            (``request.rankings``).
        attention: the attention sweep (``request.attention``; rank 0's).
    """

    metrics: dict[str, float]
    rankings: dict | None = None
    attention: AttentionReport | None = None


def evaluate(members: Member | Sequence[Member], request: EvaluationRequest) -> Evaluation:
    """Evaluate a model with its transform and tokenizer (``members``: several, an ensemble
    whose score matrices are averaged for retrieval) as ``request`` asks."""
    members = [members] if isinstance(members, Member) else list(members)
    first = members[0]
    if request.attention is not None:  # refused before the gallery's minutes, not after
        require(first.model, CrossAttentionModel, "the attention metrics")
    main_rank = not request.across_ranks or world_info()[0] == 0
    metrics, rankings, attention = {}, {} if request.rankings else None, None
    if request.split is not None:
        metrics = evaluate_retrieval(members, request.split, folds=request.folds,
                                     progress=request.progress, scoring=request.scoring,
                                     across_ranks=request.across_ranks,
                                     protocols=request.protocols, rankings=rankings,
                                     stop=request.stop)
    if request.attention is not None and request.split is not None and main_rank:
        # needs no gallery scoring: one process
        options = request.attention
        attention = attention_on_split(first, request.split, options.thresholds,
                                       options.t_iou, options.entities)
    zeroshot = {}
    if request.zeroshot is not None and main_rank:  # a small set: one process classifies it
        zeroshot = evaluate_zeroshot(first, request.zeroshot, request.zeroshot_batch_size,
                                     request.progress, request.zeroshot_workers)
    if request.across_ranks:  # every rank gets rank 0's
        zeroshot = all_objects(zeroshot)[0]
    return Evaluation({**metrics, **zeroshot}, rankings, attention)
