"""A tiny CLIP trained one epoch on the tiny synthetic benchmark, for tests of what a CLIP
fine-tune goes on to (exports, zero-shot classification, WiSE-FT)."""

from pathlib import Path

from mmgoal.engine.trainer import Trainer

# ViT-B-32 shrunk by model_kwargs (the architecture changes: the export must carry it)
MODEL_KWARGS = {"embed_dim": 16,
                "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 16,
                               "head_width": 16},
                "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32,
                             "heads": 2, "layers": 1}}
OPEN_CLIP = {"type": "OpenCLIP", "model_name": "ViT-B-32", "model_kwargs": MODEL_KWARGS}


def tiny_run(out: Path, model: dict, data: dict, work_dir: Path, **sections) -> Path:
    """``model`` trained one epoch of InfoNCE on the tiny benchmark in ``out``, into
    ``work_dir`` (its ``data`` keys over the run's; ``sections``: more of the config)."""
    cfg = {"model": model, "objective": {"type": "InfoNCELoss"},
           "optimizer": {"type": "AdamW", "lr": 1e-3},
           "data": {"num_workers": 0, "image_size": None, **data,
                    "train": {"type": "ShardDataset", "batch_size": 16, "shuffle_buffer": 32,
                              "shards": str(out / "train-{000000..000002}.tar")},
                    "val": {"shards": str(out / "val-000000.tar")}},
           "train": {"epochs": 1, "progress": False, "log_every": 1}, **sections}
    Trainer(cfg, work_dir).fit()
    return work_dir
