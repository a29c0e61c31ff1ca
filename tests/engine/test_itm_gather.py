"""ITM on each rank's own pairs over 2 processes (gloo, CPU) trains like one process holding
the global batch: under local scoring each rank draws its pairs' negatives from its rows
and its part of the loss is counted over the global batch; under replicated scoring with
``pairs: local`` the mean of the ranks' ITM losses is the global ITM loss. Either way the
data-parallel average of the gradients is the single process's."""


import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks  # tests/ranks.py

from mmgoal.data.pipeline import image_id_groups
from mmgoal.data.tokenizers import WordTokenizer
from mmgoal.engine.step import TrainingStep
from mmgoal.registry import MODELS, OBJECTIVES

CAPTIONS = ["a red circle", "a blue square left of a star", "a star", "a green cross",
            "a red star", "a blue circle above a green square", "a cross", "a red square"]
IDS = [0, 1, 2, 3, 3, 4, 5, 6]  # rows 3 and 4 (one on each rank) show the same image
PER_RANK = 4
TOKENIZER = WordTokenizer().fit(CAPTIONS)


def training_step(pairs: str, scoring: str = "local") -> TrainingStep:
    torch.manual_seed(0)
    model = MODELS.build({
        "type": "XVLM", "fusion_layers": 1, "embed_dim": 8,
        "vision": {"model_name": "vit_tiny_patch16_224",
                   "model_kwargs": {"img_size": 16, "patch_size": 8, "embed_dim": 16,
                                    "depth": 1, "num_heads": 2}},
        "text": {"config": {"model_type": "bert", "hidden_size": 16, "num_hidden_layers": 2,
                            "num_attention_heads": 2, "intermediate_size": 32,
                            "max_position_embeddings": 32}}}, tokenizer=TOKENIZER)
    objective = OBJECTIVES.build({"type": "ObjectiveSum", "terms": [
        {"type": "InfoNCELoss", "temperature": 0.1, "learnable": True},
        {"type": "ITMLoss", "temperature": 0.5, "pairs": pairs}]})
    # eval: no dropout, so two halves encode as the whole batch does (float64: tight checks)
    return TrainingStep(model, objective, scoring=scoring).double().eval()


def run(pairs: str, rows: slice, scoring: str = "local") -> dict:
    """Losses, averaged gradients and ITM pair count of one step on the global batch's ``rows``."""
    step = training_step(pairs, scoring)
    images = torch.randn(len(IDS), 3, 16, 16, dtype=torch.float64,
                         generator=torch.Generator().manual_seed(1))[rows]
    ids = IDS[rows]
    batch = {"images": images, **TOKENIZER(CAPTIONS[rows]), "image_ids": ids,
             "image_groups": image_id_groups(ids)}
    fused = []
    match_logits = step.model.match_logits
    step.model.match_logits = lambda i, t: fused.append(len(t.tokens)) or match_logits(i, t)
    torch.manual_seed(2)  # the same ITM draws on every rank and in one process
    outputs = step(batch)
    outputs["loss"].backward()
    grads = {}
    for name, p in step.named_parameters():
        if p.grad is not None:
            if dist.is_initialized():  # what data parallel does: average the ranks' gradients
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
            grads[name] = p.grad
    return {"losses": {k: v.detach() for k, v in outputs.items()}, "grads": grads,
            "fused": fused}


def on_rank(rank, world):
    rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    return {"local scoring": run("local", rows),
            **{pairs: run(pairs, rows, "replicated") for pairs in ("local", "global")}}


@pytest.mark.multiprocess
def test_local_itm_over_two_ranks_trains_like_global_itm_in_one_process(tmp_path):
    ranks = run_ranks(on_rank, tmp_path)
    single = run("local", slice(None))  # one process: local and global are the same
    assert single["fused"] == [3 * 2 * PER_RANK]
    local = [r["local"] for r in ranks]
    assert [r["fused"] for r in local] == [[3 * PER_RANK]] * 2  # the rank's pairs only
    itm = [r["losses"]["itm_loss"] for r in local]
    assert not torch.allclose(itm[0], itm[1])
    torch.testing.assert_close((itm[0] + itm[1]) / 2, single["losses"]["itm_loss"])
    for result in local:
        torch.testing.assert_close(result["losses"]["infonce_loss"],
                                   single["losses"]["infonce_loss"])
        assert result["grads"].keys() == single["grads"].keys()
        for name, grad in single["grads"].items():
            torch.testing.assert_close(result["grads"][name], grad, msg=name)
    for result in (r["local scoring"] for r in ranks):  # each rank's rows and pairs
        assert result["fused"] == [3 * PER_RANK]
        for key in ("infonce_loss", "itm_loss", "itm_accuracy"):
            torch.testing.assert_close(result["losses"][key], single["losses"][key], msg=key)
        assert result["grads"].keys() == single["grads"].keys()
        for name, grad in single["grads"].items():
            torch.testing.assert_close(result["grads"][name], grad, msg=name)
    for result in (r["global"] for r in ranks):  # the old way: every pair on every rank
        assert result["fused"] == [3 * 2 * PER_RANK]
        torch.testing.assert_close(result["losses"]["itm_loss"], single["losses"]["itm_loss"])
