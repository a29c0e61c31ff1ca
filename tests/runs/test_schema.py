"""The run config's schema: defaults written out, overrides of any key something knows."""

import sys
from pathlib import Path

import pytest

from mmgoal.config import find_config
from mmgoal.runs.schema import RunConfig, TrainConfig, load_run_config, resolve_config

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"


def test_defaults_are_written_out_and_the_file_wins():
    cfg = load_run_config(QUICKSTART)
    assert cfg["train"]["epochs"] == 14  # the file's
    assert cfg["train"]["accumulate_steps"] == 1 and cfg["train"]["sync_bn"] is False  # defaults
    assert cfg["strategy"] == {"type": "torch"}
    assert cfg["evaluation"]["matmul_precision"] == "highest"
    assert cfg["data"]["val"] == {"shards": "data/synthetic/val-*.tar", "folds": 1,
                                  "caption_key": None}
    assert set(cfg) == set(RunConfig.keys())
    assert resolve_config(cfg) == cfg  # resolving is idempotent


def test_overrides_of_defaulted_keys_and_of_a_components_options():
    cfg = load_run_config(QUICKSTART, [
        "train.accumulate_steps=4", "evaluation.matmul_precision=medium",
        "data.train.resampled=true",  # a ShardDataset option the file does not set
        "schedule.min_ratio=0.1",  # a cosine option
        "strategy.type=deepspeed", "strategy.zero_stage=3",  # the new type's options count
    ])
    assert cfg["train"]["accumulate_steps"] == 4
    assert cfg["evaluation"]["matmul_precision"] == "medium"
    assert cfg["data"]["train"]["resampled"] is True
    assert cfg["schedule"] == {"type": "cosine", "warmup_steps": 100, "min_ratio": 0.1}
    assert cfg["strategy"] == {"type": "deepspeed", "zero_stage": 3}


@pytest.mark.parametrize("override,message", [
    ("train.acumulate_steps=4", "no key 'acumulate_steps' under train. Did you mean "
                                "'accumulate_steps'?"),
    ("strategy.zero_stage=3", "no key 'zero_stage' under strategy"),  # not a torch option
    ("schedule.milestones=[3]", "no key 'milestones' under schedule"),  # a step option
    ("evaluation.matmul_precision=low", "evaluation.matmul_precision must be highest, high or "
                                        "medium, got 'low'"),
    ("train.precision=bf61", "train.precision must be fp32, bf16 or fp16, got 'bf61'"),
    ("train.matmul_precision=hihg", "train.matmul_precision must be highest, high or medium, "
                                    "got 'hihg'"),
    ("train.scale_lr=cubic", "train.scale_lr must be none, linear or sqrt, got 'cubic'"),
    ("train.scoring=rows", "train.scoring must be local or replicated, got 'rows'"),
    ("modle.embed_dim=8", "no key 'modle' under the top level. Did you mean 'model'?"),
    ("objective.type=TripletLos", "'TripletLos' is not in the objective registry. Did you mean "
                                  "'TripletLoss'?"),
    # types and ranges, of the trainer's sections and of the components' own options
    ("train.epochs=two", "train.epochs must be an integer, got 'two'"),
    ("train.accumulate_steps=0", "train.accumulate_steps must be at least 1, got 0"),
    ("train.keep_epochs=-1", "train.keep_epochs must be at least 0, got -1"),
    ("train.progress=1", "train.progress must be true or false, got 1"),
    ("data.train.batch_size=3.5", "data.train.batch_size must be an integer, got 3.5"),
    ("optimizer.lr=abc", "optimizer.lr must be a number, got 'abc'"),
    ("objective.margin=[1]", "objective.margin must be a number, got [1]"),
    ("evaluation.block_images=0", "evaluation.block_images must be at least 1, got 0"),
    ("evaluation.max_block_mb=-1", "evaluation.max_block_mb must be above 0, got -1"),
    ("data.val.folds=0", "data.val.folds must be at least 1, got 0"),
    # the optimizer's keys that mmgoal reads itself (tests/engine/test_optimizers.py has more)
    ("optimizer.no_decay=['bias', 'nrom']", "optimizer.no_decay[1] must be bias, norm, "
                                            "embedding, temperature or vector, got 'nrom'"),
    ("train.eval_before_training=1", "train.eval_before_training must be true or false, got 1"),
])
def test_keys_nothing_knows_and_bad_values_are_errors(override, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("[", r"\[")
                       .replace("?", r"\?")):
        load_run_config(QUICKSTART, [override])


def test_parameter_group_options_and_eval_before_training_are_keys_overrides_may_set():
    cfg = load_run_config(QUICKSTART, [
        "optimizer.no_decay=['bias', 'norm']",
        "optimizer.layer_decay={'rate': 0.75, 'modules': ['image_encoder']}",
        "train.eval_before_training=true"])
    assert cfg["optimizer"]["no_decay"] == ["bias", "norm"]
    assert cfg["optimizer"]["layer_decay"] == {"rate": 0.75, "modules": ["image_encoder"]}
    assert cfg["train"]["eval_before_training"] is True
    assert "no_decay" not in load_run_config(QUICKSTART)["optimizer"]  # today's groups
    with pytest.raises(ValueError, match="train.eval_before_training evaluates on data.val, "
                                         "which the config lacks"):
        load_run_config(QUICKSTART, ["train.eval_before_training=true", "data.val=None"])


def test_section_schema_reports_unknown_and_missing_keys():
    with pytest.raises(ValueError, match=r"unknown key\(s\) 'epoch' \(did you mean 'epochs'\?\) "
                                         r"in 'train'"):
        TrainConfig.from_dict({"epoch": 3}, "train")
    with pytest.raises(ValueError, match="the config has no data.val.shards"):
        resolve_config({**load_run_config(QUICKSTART),
                        "data": {**load_run_config(QUICKSTART)["data"], "val": {"folds": 5}}})
    with pytest.raises(ValueError, match="'objective' must be a mapping with a 'type' key"):
        resolve_config({**load_run_config(QUICKSTART), "objective": {"margin": 0.2}})


def test_a_plugin_module_beside_the_config_is_found(tmp_path, monkeypatch):
    from mmgoal.registry import OBJECTIVES

    monkeypatch.setattr(sys, "path", list(sys.path))  # the config's folder joins it
    (tmp_path / "beside_plugin.py").write_text(
        "from mmgoal.objectives.triplet import TripletLoss\n"
        "from mmgoal.registry import OBJECTIVES\n"
        "@OBJECTIVES.register()\n"
        "class BesideTriplet(TripletLoss):\n"
        "    def __init__(self, gamma: float = 1.0, **kwargs):\n"
        "        super().__init__(**kwargs)\n"
        "        self.gamma = gamma\n")
    (tmp_path / "broken_plugin.py").write_text("import no_such_dependency_xyz\n")
    config = tmp_path / "run.yaml"
    config.write_text(f"_base_: {QUICKSTART}\ncustom_imports: [beside_plugin]\n"
                      "objective: {_delete_: true, type: BesideTriplet}\n")
    try:
        # the plug-in's own option is a known key for --cfg-options
        cfg = load_run_config(config, ["objective.gamma=2.0", "objective.margin=0.1"])
        assert cfg["objective"] == {"type": "BesideTriplet", "gamma": 2.0, "margin": 0.1}
        broken = tmp_path / "broken.yaml"
        broken.write_text(f"_base_: {QUICKSTART}\ncustom_imports: [broken_plugin]\n")
        with pytest.raises(ImportError, match="custom_imports lists 'broken_plugin', which "
                                              "cannot be imported: No module named "
                                              "'no_such_dependency_xyz'"):
            load_run_config(broken)
    finally:
        OBJECTIVES._entries.pop("BesideTriplet", None)
        for name in ("beside_plugin", "broken_plugin"):
            sys.modules.pop(name, None)


def test_a_negative_batch_size_stops_before_any_data_is_read():
    from mmgoal.data.tokenizers import WordTokenizer
    from mmgoal.registry import DATASETS

    with pytest.raises(ValueError, match="ShardDataset': batch_size must be at least 1, got -4"):
        DATASETS.build({"type": "ShardDataset", "shards": "nowhere-{0..3}.tar",
                        "batch_size": -4}, tokenizer=WordTokenizer(vocab=["a"]), transform=None)
    with pytest.raises(ValueError, match="data.train.batch_size must be at least 1, got 0"):
        load_run_config(find_config("quickstart"), ["data.train.batch_size=0"])  # the config
