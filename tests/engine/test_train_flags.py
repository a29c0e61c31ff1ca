"""open_clip_train's flags on mmgoal train: each sets its config key, --help names it;
towers locked as open_clip locks them; the trainable count at each phase."""

import logging
import re

import pytest
from test_trainer import tiny_config  # same folder: pytest puts it on sys.path

from mmgoal.cli.arguments import TRAIN_SHORTCUTS, shortcut_overrides
from mmgoal.cli.train import parse_args
from mmgoal.engine.trainer import Trainer
from mmgoal.registry import MODELS
from mmgoal.runs.schema import with_overrides

FLAGS = ["--train-data", "data/{000..003}.tar", "--val-data", "val/", "--test-data", "t.tar",
         "--batch-size", "64", "--lr", "5e-4", "--wd", "0.1", "--warmup", "100",
         "--epochs", "3", "--model", "ViT-B-16", "--pretrained", "openai",
         "--precision", "amp_bf16", "--workers", "4", "--seed", "7", "--lock-image",
         "--lock-image-unlocked-groups", "2", "--lock-text", "--lock-text-unlocked-layers", "1"]
SET = {"data.train.shards": "data/{000..003}.tar", "data.val.shards": "val/",
       "data.test.shards": "t.tar", "data.train.batch_size": 64, "optimizer.lr": 5e-4,
       "optimizer.weight_decay": 0.1, "schedule.warmup_steps": 100, "train.epochs": 3,
       "model.model_name": "ViT-B-16", "model.pretrained": "openai",
       "train.precision": "bf16", "data.num_workers": 4, "train.seed": 7,
       "train.lock_image": True, "train.lock_image_unlocked_groups": 2,
       "train.lock_text": True, "train.lock_text_unlocked_layers": 1}


def value(cfg, key):
    for part in key.split("."):
        cfg = cfg[part]
    return cfg


def test_each_flag_sets_its_key_and_help_names_it(capsys):
    cfg = {"model": {"type": "OpenCLIP", "model_name": "ViT-B-32"},
           "objective": {"type": "InfoNCELoss"}, "optimizer": {"type": "AdamW", "lr": 1e-3},
           "schedule": {"type": "cosine", "warmup_steps": 10},
           "data": {"train": {"type": "ShardDataset", "shards": "x.tar"},
                    "val": {"shards": "v.tar"}, "test": {"shards": "t.tar"}}}
    args = parse_args(["c.yaml", *FLAGS, "--cfg-options", "train.seed=8"])
    overrides = shortcut_overrides(args, TRAIN_SHORTCUTS, cfg)
    assert len(overrides) == len(SET)
    resolved = with_overrides(cfg, [*overrides, *args.cfg_options])
    assert {key: value(resolved, key) for key in SET} == {**SET, "train.seed": 8}
    # --model follows the model's type; another family is told what to do
    hf = {**cfg, "model": {"type": "HFCLIP", "path": "a"}}
    assert "model.path=\"ViT-B-16\"" in shortcut_overrides(args, TRAIN_SHORTCUTS, hf)
    with pytest.raises(ValueError, match="this config's model is DualEncoder: set its keys"):
        shortcut_overrides(args, TRAIN_SHORTCUTS, {"model": {"type": "DualEncoder"}})
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    for shortcut in TRAIN_SHORTCUTS:
        keys = shortcut.key.values() if isinstance(shortcut.key, dict) else [shortcut.key]
        assert shortcut.flag in shown and all(f"{key}" in shown for key in keys)


def test_resume_a_run_folder_reads_its_config(tmp_path, capsys):
    import yaml

    from mmgoal.cli import train
    from mmgoal.runs.run_dir import record_changes

    args = parse_args(["--resume", str(tmp_path)])
    assert (args.config, args.work_dir) == (str(tmp_path / "config.yaml"), str(tmp_path))
    assert parse_args(["c.yaml", "--resume"]).resume == "latest"
    with pytest.raises(SystemExit):
        parse_args(["--epochs", "2"])
    assert "the config is required" in capsys.readouterr().err
    # the config the run goes on with: config.yaml and what earlier resumes changed
    from mmgoal.cli.arguments import config_argument
    from mmgoal.config import load_config

    (tmp_path / "config.yaml").write_text(yaml.safe_dump(with_overrides(
        load_config(config_argument("quickstart")), ["train.epochs=1"])))
    record_changes(tmp_path, {"train.epochs": [1, 6], "optimizer.lr": [0.001, 0.002]}, 2, 9)
    for argv in (["--resume", str(tmp_path)], ["--work-dir", str(tmp_path), "--resume"],
                 ["--resume", str(tmp_path / "checkpoints" / "last.pt")]):  # open_clip's habit
        if "last.pt" in argv[-1]:
            (tmp_path / "checkpoints").mkdir()
            (tmp_path / "checkpoints" / "last.pt").touch()
        assert train.main([*argv, "--print-config"]) == 0
        printed = yaml.safe_load(capsys.readouterr().out)
        assert (printed["train"]["epochs"], printed["optimizer"]["lr"]) == (6, 0.002), argv
    (tmp_path / "other.pt").touch()
    with pytest.raises(SystemExit):
        parse_args(["--resume", str(tmp_path / "other.pt")])
    assert "--resume takes a run folder (the run goes on from its checkpoints/last.pt)" in \
        capsys.readouterr().err


def numel(*modules):
    return sum(p.numel() for module in modules for p in module.parameters())


def counts_said(caplog):
    return [(int(m.split()[1].rstrip(":")), int(m.split()[4])) for m in caplog.messages
            if "trainable parameters" in m]


def test_trainable_count_follows_locks_and_freeze_phases(tiny_benchmark, tmp_path, caplog):
    out, _ = tiny_benchmark
    cfg = tiny_config(out, epochs=2, lock_text=True)
    cfg["hooks"] = [{"type": "FreezeSchedule", "frozen": ["image_encoder.model"],
                     "unfreeze": {1: ["image_encoder.model"]}}]
    cfg["data"].pop("test")
    with caplog.at_level(logging.INFO, logger="mmgoal.engine.trainer"):
        trainer = Trainer(cfg, tmp_path / "run")
        model = trainer.model
        total = numel(model)
        text = numel(model.text_encoder, model.text_proj)
        trainer.fit()
    # epoch 0: the text tower locked, the backbone frozen by the schedule; epoch 1: thawed
    assert counts_said(caplog) == [(0, total - text - numel(model.image_encoder.model)),
                                   (1, total - text)]
    assert trainer.parameter_counts == {"trainable": total - text, "total": total}


def test_locks_keep_the_last_groups_as_open_clip_does():
    hf = MODELS.build({"type": "HFCLIP", "config": {
        "model_type": "clip",
        "vision_config": {"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 3,
                          "num_attention_heads": 2, "image_size": 32, "patch_size": 16},
        "text_config": {"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 2,
                        "num_attention_heads": 2, "max_position_embeddings": 16},
        "projection_dim": 8}})
    hf.lock_image_tower(2)  # trainable: the last layer with the final norm, the projection
    trainable = {name.split(".")[2] if name.startswith("model.vision_model") else name
                 for name, p in hf.named_parameters() if p.requires_grad
                 and ("vision" in name or "visual" in name)}
    assert trainable == {"encoder", "post_layernorm", "model.visual_projection.weight"}
    assert [n for n, p in hf.named_parameters()
            if p.requires_grad and "vision_model.encoder" in n][0].startswith(
        "model.vision_model.encoder.layers.2.")
    with pytest.raises(ValueError, match="HFCLIP's text tower has 4 layer groups; 4 unlocked"):
        hf.lock_text_tower(4)


def test_validation_every_n_steps_keeps_the_best_and_stops_early(tiny_benchmark, tmp_path,
                                                                 caplog):
    """Hugging Face Trainer's habits: eval_steps, metric_for_best_model, early stopping."""
    import json

    from mmgoal.runs.checkpoint import load_checkpoint

    out, _ = tiny_benchmark
    cfg = tiny_config(out, epochs=3, eval_every_steps=2, best_metric="i2t_r1",
                      early_stopping_patience=2)
    cfg["optimizer"]["lr"] = 0.0  # nothing learns: no validation gains on the first
    cfg["data"].pop("test")
    report = Trainer(cfg, tmp_path / "run").fit()
    records = [json.loads(line) for line in
               (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    vals = [r for r in records if r["type"] == "val"]
    # 6 steps an epoch: validations at steps 2, 4, then early stopping (2 without a gain)
    assert [(r["epoch"], r["step"]) for r in vals] == [(0, 2), (0, 4), (0, 6)]
    assert report["best"] == {"i2t_r1": vals[0]["i2t_r1"], "epoch": 0, "step": 2}
    state = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")
    assert state["stopped_early"] and state["validations_since_best"] == 2
    assert load_checkpoint(tmp_path / "run" / "checkpoints" / "best.pt")["metrics"][
        "i2t_r1"] == vals[0]["i2t_r1"]
    # a resumed run that stopped early is done, unless it is given more patience
    again = Trainer(cfg, tmp_path / "run", resume=True)
    with caplog.at_level(logging.WARNING, logger="mmgoal.engine.trainer"):
        assert again.fit()["best"] == report["best"] and again.step == 6
    assert ("the run stopped early at step 6, 2 validations without a gain: nothing is left "
            "to train (train on with --cfg-options train.early_stopping_patience=3 or more, "
            "or 0); its report stands") in caplog.text
    cfg["train"]["early_stopping_patience"] = 3
    assert Trainer(cfg, tmp_path / "run", resume=True).fit()["steps"] == 8
    vals = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
            .splitlines() if json.loads(line)["type"] == "val"]
    assert [(r["epoch"], r["step"]) for r in vals] == [(0, 2), (0, 4), (0, 6), (1, 8)]
    # refused before anything is built
    cfg.update(train={**cfg["train"], "best_metric": "rsun", "early_stopping_patience": 0})
    with pytest.raises(ValueError, match="train.best_metric 'rsun' \\(did you mean 'rsum'\\?\\) "
                                         "is not a metric validation reports; choose one of "
                                         "i2t_r1, .*t2i_r10, rsum$"):
        Trainer(cfg, tmp_path / "other")
    assert not (tmp_path / "other").exists()


@pytest.mark.parametrize(("name", "zeroshot", "why"), [
    ("t2i_medr", False, "is a rank: lower is better"),
    ("zeroshot_top1", False, "zero-shot accuracies need evaluation.zeroshot"),
    ("zeroshot_top_1", True, "did you mean 'zeroshot_top1'"),
])
def test_a_best_metric_validation_cannot_maximise_is_refused(name, zeroshot, why):
    from mmgoal.evaluation.request import check_best_metric

    with pytest.raises(ValueError, match=re.escape(why)):
        check_best_metric(name, zeroshot)
    check_best_metric("zeroshot_mean_per_class_recall", zeroshot=True)  # these are fine
    check_best_metric("i2t_r5", zeroshot=False)


def test_validation_every_n_steps_does_not_wait_for_the_epoch_schedule(tiny_benchmark,
                                                                       tmp_path):
    """A step validation that falls on an epoch's last step is the epoch end's, which
    validates it though train.eval_every would not."""
    import json

    out, _ = tiny_benchmark
    cfg = tiny_config(out, epochs=2, eval_every=0, eval_every_steps=3)
    cfg["data"].pop("test")
    Trainer(cfg, tmp_path / "run").fit()
    vals = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
            .splitlines() if json.loads(line)["type"] == "val"]
    assert [(r["epoch"], r["step"]) for r in vals] == [(0, 3), (0, 6), (1, 9), (1, 12)]


def test_a_best_checkpoint_of_abandoned_progress_is_set_aside_on_resume(tiny_benchmark,
                                                                        tmp_path, caplog):
    """Continuing from an earlier epoch (docs/configs.md): the best.pt a later epoch wrote
    is not the resumed run's, and its final test never takes it."""
    from mmgoal.runs.checkpoint import load_checkpoint, save_checkpoint

    out, _ = tiny_benchmark
    cfg = tiny_config(out, epochs=1)
    cfg["data"].pop("test")
    run = tmp_path / "run"
    Trainer(cfg, run).fit()
    best = run / "checkpoints" / "best.pt"
    later = load_checkpoint(best)  # as if a later epoch, since abandoned, had written it
    later["metrics"]["rsum"] = 999.0
    save_checkpoint(later, best)
    cfg["train"]["epochs"] = 2
    with caplog.at_level(logging.WARNING, logger="mmgoal.engine.trainer"):
        report = Trainer(cfg, run, resume=True).fit()
    assert f"{best} (rsum 999.0) is not the best of the checkpoint resumed" in caplog.text
    assert load_checkpoint(run / "checkpoints" / "best.pt.later")["metrics"]["rsum"] == 999.0
    assert report["best"]["epoch"] == 1  # chosen again from the resumed validations
    assert load_checkpoint(best)["epoch"] == 1


def test_a_validation_gives_every_module_its_own_mode_back():
    """A validation between steps leaves a FreezeSchedule's frozen norms in eval mode."""
    from torch import nn

    from mmgoal.evaluation.gallery import in_eval_mode

    model = nn.Sequential(nn.BatchNorm1d(2), nn.Linear(2, 2))
    model.train()
    model[0].eval()
    seen = in_eval_mode(lambda m: [module.training for module in m.modules()])(model)
    assert seen == [False, False, False]
    assert [module.training for module in model.modules()] == [True, False, True]


def test_train_log_holds_the_test_table_and_no_bar_is_drawn_off_a_terminal(
        tiny_quickstart_run):
    import json

    from mmgoal.console import bars_drawn, progress_bar
    from mmgoal.evaluation.retrieval import metrics_table

    run, _ = tiny_quickstart_run
    report = json.loads((run / "report.json").read_text())
    log = (run / "train.log").read_text()
    assert f"test metrics of the best epoch ({report['best']['epoch']})" in log
    assert "global batch 16 = 16 per rank x 1 rank(s)" in log  # the setup's lines too
    assert metrics_table(report["test"]) in log
    # under pytest stderr is no terminal: no bar, so the run logs its step lines instead
    assert not bars_drawn(True) and progress_bar(range(2), show=True).disable
    assert "\r" not in log and "epoch 0 step 2/" in log


def test_deepspeed_on_a_cpu_says_it_compiles_its_extension_first(tmp_path, monkeypatch,
                                                                 caplog):
    from mmgoal.engine.strategies.deepspeed import say_cpu_extension_build

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    with caplog.at_level(logging.WARNING):
        assert say_cpu_extension_build()
    assert f"it is kept in {tmp_path}" in caplog.text and "about a minute" in caplog.text
    built = tmp_path / "py311_cpu" / "deepspeed_shm_comm"
    built.mkdir(parents=True)
    (built / "deepspeed_shm_comm.so").touch()
    assert not say_cpu_extension_build()  # built: nothing to say


def test_eval_takes_the_flags_that_apply_to_it(tiny_quickstart_run, monkeypatch):
    import mmgoal.cli.evaluate as evaluate
    import mmgoal.runs.loading as loading

    run, _ = tiny_quickstart_run
    given = {}

    def load(checkpoint, config, overrides, *args, **kwargs):
        given["overrides"] = overrides
        raise FileNotFoundError("stop here")

    monkeypatch.setattr(loading, "load_for_evaluation", load)
    assert evaluate.main([str(run), "--batch-size", "7", "--workers", "0", "--cfg-options",
                          "data.eval_batch_size=9"]) == 2
    assert given["overrides"] == ["data.eval_batch_size=7", "data.num_workers=0",
                                  "data.eval_batch_size=9"]  # the last one wins
