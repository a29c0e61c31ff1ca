"""One evaluation call: the metrics of the retrieval and zero-shot calls it makes, in that
order of keys; zero-shot alone without a split; the attention metrics refused up front."""

import pytest

from mmgoal.data.classification import write_synthetic_classification
from mmgoal.data.pipeline import EvalReader
from mmgoal.evaluation.gallery import evaluate_retrieval
from mmgoal.evaluation.request import AttentionRequest, EvaluationRequest, evaluate
from mmgoal.evaluation.zeroshot import evaluate_zeroshot
from mmgoal.runs.loading import load_for_evaluation


def test_evaluate_gives_the_retrieval_then_the_zero_shot_metrics(tiny_quickstart_run,
                                                                  tmp_path):
    run, out = tiny_quickstart_run
    loaded = load_for_evaluation(run, device="cpu")
    reader = EvalReader(f"{out}/val-000000.tar", batch_size=8)
    cset = write_synthetic_classification(tmp_path / "shapes", "shape", count=12,
                                          image_size=32)
    request = EvaluationRequest(split=reader, zeroshot=cset, zeroshot_batch_size=5,
                                progress=False)
    evaluation = evaluate(loaded, request)
    retrieval = evaluate_retrieval([loaded], reader, progress=False)
    zeroshot = evaluate_zeroshot(loaded, cset, 5, progress=False)
    assert evaluation.metrics == pytest.approx({**retrieval, **zeroshot}, abs=1e-9)
    assert list(evaluation.metrics) == [*retrieval, *zeroshot]
    assert evaluation.rankings is None and evaluation.attention is None
    request.split = None
    assert evaluate(loaded, request).metrics == pytest.approx(zeroshot, abs=1e-9)
    request.split, request.attention = reader, AttentionRequest([0.0, 0.1])
    with pytest.raises(ValueError, match="the attention metrics needs a CrossAttentionModel"):
        evaluate(loaded, request)
