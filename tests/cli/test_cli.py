import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from fault_hooks import InfRunningVariances
from script_modules import load_tool

from mmgoal.data.pipeline import EvalReader, iter_eval_batches
from mmgoal.registry import HOOKS
from mmgoal.runs.checkpoint import load_checkpoint, save_checkpoint
from mmgoal.runs.run_dir import existing_run_files, prepare_work_dir

ROOT = Path(__file__).resolve().parents[2]


def run_tool(*args, cwd=ROOT):
    return subprocess.run([sys.executable, *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=600)


def tiny_overrides(base: str, out: Path, **extra) -> dict:
    """A config on ``base`` shrunk to the tiny benchmark (a few seconds an epoch)."""
    return {
        "_base_": str(ROOT / "configs" / base),
        "model": {"embed_dim": 16, "image_encoder": {"model_kwargs": {"widths": [8, 16]}},
                  "text_encoder": {"word_dim": 8, "hidden_size": 16}},
        "data": {"image_size": 32, "num_workers": 0,
                 "train": {"shards": str(out / "train-{000000..000002}.tar"), "batch_size": 16},
                 "val": {"shards": str(out / "val-000000.tar")},
                 "test": {"shards": str(out / "test-{000000..000001}.tar")}},
        **extra,
    }


@pytest.fixture
def tiny_config_file(tiny_benchmark, tmp_path):
    out, _ = tiny_benchmark
    cfg = tiny_overrides("quickstart.yaml", out, train={"epochs": 2, "progress": False})
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow
def test_finetune_then_evaluate_agree(tiny_config_file, tmp_path):
    work = tmp_path / "run"
    # --auto-resume starts afresh in an empty work directory...
    result = run_tool("tools/finetune.py", tiny_config_file, "--work-dir", work,
                      "--cfg-options", "optimizer.lr=0.003", "--auto-resume")
    assert result.returncode == 0, result.stderr
    assert "rsum" in result.stdout and "R@1" in result.stdout and "resumed" not in result.stderr
    report = json.loads((work / "report.json").read_text())
    assert yaml.safe_load((work / "config.yaml").read_text())["optimizer"]["lr"] == 0.003
    result = run_tool("tools/evaluate.py", tiny_config_file, work / "checkpoints" / "best.pt",
                      "--out", tmp_path / "eval.json")
    assert result.returncode == 0, result.stderr
    evaluated = json.loads((tmp_path / "eval.json").read_text())["metrics"]
    for key, value in report["test"].items():
        assert evaluated[key] == pytest.approx(value), key
    assert f"{report['test']['rsum']:.2f}" in result.stdout
    if not torch.cuda.is_available():  # a GPU asked for where there is none: said, not a trace
        result = run_tool("tools/evaluate.py", tiny_config_file, work / "checkpoints" / "best.pt",
                          "--device", "cuda")
        assert result.returncode == 2
        assert "error: --device 'cuda' asks for a GPU, but this machine has no CUDA device" \
            in result.stderr
    # the collapse check scores the same checkpoint: its positive median is the diagonal's
    result = run_tool("tools/score_stats.py", work, "--pairs", "1000")
    assert result.returncode == 0, result.stderr
    assert "(epoch" in result.stdout and "40 pairs" in result.stdout
    stats = load_tool("score-stats").score_stats(work, "test", 1000)
    assert f"positive median {stats['positive_median']:.2f}" in result.stdout
    assert stats["negative_q25"] <= stats["negative_median"] <= stats["negative_q75"]
    # in batches of 4, each image's hardest negative is the best of its batch's 3 others
    loaded = load_tool("score-stats").load_model(work)
    reader = EvalReader(loaded.split("test")["shards"], 40)
    batch = next(iter_eval_batches(reader, loaded.transform))
    with torch.no_grad():
        texts = loaded.model.encode_text(loaded.tokenizer([c[0] for c in batch["captions"]]))
        sims = loaded.model.similarity(loaded.model.encode_image(batch), texts)
    blocks = sims.reshape(10, 4, 10, 4).diagonal(dim1=0, dim2=2).permute(2, 0, 1)  # 10 x 4 x 4
    hardest = blocks.masked_fill(torch.eye(4, dtype=torch.bool), -2).amax(-1).flatten()
    small = load_tool("score-stats").score_stats(work, "test", 1000, batch_size=4)
    assert small["negative_median"] == pytest.approx(hardest.median().item(), abs=1e-6)
    assert small["positive_median"] == pytest.approx(stats["positive_median"], abs=1e-6)
    assert small["negative_median"] < stats["negative_median"]
    # ...and resumes where it has a checkpoint (here: the end, so nothing is trained)
    result = run_tool("tools/finetune.py", tiny_config_file, "--work-dir", work,
                      "--cfg-options", "optimizer.lr=0.003", "--auto-resume")
    assert result.returncode == 0, result.stderr
    assert "resumed at epoch 2, step" in result.stderr


def test_finetune_reports_config_mistakes(tiny_config_file, tmp_path, capsys):
    finetune = load_tool("train")  # in this process: each case fails before training

    def refused(*argv) -> str:
        assert finetune.main([str(a) for a in (tiny_config_file, *argv)]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        return err

    assert "no key 'lrr' under optimizer" in refused("--work-dir", tmp_path / "x",
                                                     "--cfg-options", "optimizer.lrr=1")
    assert "--resume: no checkpoint at" in refused("--work-dir", tmp_path / "new", "--resume")
    assert "mmgoal make-synthetic" in refused("--work-dir", tmp_path / "x", "--cfg-options",
                                              "data.train.shards=/nowhere/train-{0..3}.tar")
    # a mistake found as the run sets up leaves its log, and the corrected run starts there
    assert "set train.lock_text (--lock-text) too" in refused(
        "--work-dir", tmp_path / "setup", "--lock-text-unlocked-layers", "1")
    assert not (tmp_path / "setup").exists()  # the config's own mistake: before the folder
    assert "layer groups; 99 unlocked" in refused("--work-dir", tmp_path / "setup",
                                                  "--lock-image", "--lock-image-unlocked-groups",
                                                  "99")
    assert existing_run_files(tmp_path / "setup") == ["train.log"]
    assert prepare_work_dir(tmp_path / "setup", resume=False) == []
    # a folder holding a run is never trained over, and a resume keeps the run's model
    finished = tmp_path / "finished"
    (finished / "checkpoints").mkdir(parents=True)
    (finished / "config.yaml").write_text(tiny_config_file.read_text())
    (finished / "checkpoints" / "last.pt").write_bytes(b"a finished run's")
    assert "already holds a run (config.yaml, checkpoints/last.pt)" in refused(
        "--work-dir", finished)
    assert "model.embed_dim: 16 -> 8" in refused("--work-dir", finished, "--resume",
                                                 "--cfg-options", "model.embed_dim=8")
    assert (finished / "checkpoints" / "last.pt").read_bytes() == b"a finished run's"


def test_misleading_inputs_get_messages_that_say_what_happened(tiny_quickstart_run, tmp_path,
                                                               capsys):
    run, _ = tiny_quickstart_run
    finetune, evaluate = load_tool("train"), load_tool("eval")
    deepspeed_config = str(ROOT / "configs" / "distributed" / "quickstart_zero2.yaml")
    # a run folder as the config, or as load_from
    assert finetune.main([str(run), "--print-config"]) == 2
    assert (f"config {run} is a folder, not a YAML file; a run folder's own config is "
            f"{run / 'config.yaml'}") in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match=rf"checkpoint {run} is a folder, not a "
                                                rf"checkpoint file; give a file such as"):
        load_checkpoint(run)
    # --deepspeed switches the strategy before the overrides, so DeepSpeed's keys are known
    assert finetune.main([str(ROOT / "configs" / "quickstart.yaml"), "--deepspeed",
                          "--print-config", "--cfg-options", "strategy.zero_stage=3"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["strategy"] == {"type": "deepspeed",
                                                                   "zero_stage": 3}
    # another type for a component: the whole section, as a YAML flow mapping
    assert finetune.main([deepspeed_config, "--print-config", "--cfg-options",
                          "strategy.type=ddp"]) == 2
    assert ("strategy.type changed the component's type and kept the options of the old one: "
            "to switch a component, replace its whole section, e.g. --cfg-options "
            "'strategy={type: NAME, option: value}'") in capsys.readouterr().err
    assert finetune.main([deepspeed_config, "--print-config", "--cfg-options",
                          "strategy={type: ddp, bucket_mb: 50}"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["strategy"] == {"type": "ddp",
                                                                   "bucket_mb": 50}
    # evaluate with its two paths swapped: said, not torch's weights-only explanation
    config = run / "config.yaml"
    assert evaluate.main([str(run / "checkpoints" / "best.pt"), str(config)]) == 2
    err = capsys.readouterr().err
    assert f"{config} is a config, not a checkpoint: a tool that takes both wants [CONFIG] " \
           f"CHECKPOINT" in err and "weights_only" not in err


def test_a_diverged_run_and_its_checkpoints_end_in_errors_not_tracebacks(tiny_config_file,
                                                                        tmp_path, capsys):
    finetune, evaluate = load_tool("train").main, load_tool("eval").main
    (tmp_path / "taken").write_text("")
    assert finetune([str(tiny_config_file), "--work-dir", str(tmp_path / "taken")]) == 2
    assert f"error: --work-dir {tmp_path / 'taken'} is a file" in capsys.readouterr().err

    cfg = yaml.safe_load(tiny_config_file.read_text())
    cfg["train"] = {"epochs": 1, "progress": False, "checkpoint_every_steps": 2}
    cfg["hooks"] = [{"type": "InfRunningVariances", "steps": 3}]
    (tmp_path / "diverging.yaml").write_text(yaml.safe_dump(cfg))
    HOOKS.register("InfRunningVariances", force=True)(InfRunningVariances)
    try:
        code = finetune([str(tmp_path / "diverging.yaml"), "--work-dir", str(tmp_path / "run")])
    finally:
        HOOKS._entries.pop("InfRunningVariances")
    assert code == 1
    assert re.search(r"error: the model holds NaN or inf in \d+ tensors .* at step 4 .*the last "
                     r"good checkpoint in \S+ is intact", capsys.readouterr().err)

    # a checkpoint an older mmgoal wrote as its run diverged
    last = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")
    name = next(k for k in last["model"] if k.endswith("running_var"))
    last["model"][name].fill_(math.nan)
    save_checkpoint(last, tmp_path / "old.pt")
    assert evaluate([str(tiny_config_file), str(tmp_path / "old.pt")]) == 2
    assert f"error: checkpoint {tmp_path / 'old.pt'} holds NaN or inf in 1 tensor ({name})" \
        in capsys.readouterr().err


def test_print_config_shows_defaults_and_overrides(tiny_config_file, tmp_path):
    from mmgoal.runs.schema import load_run_config

    result = run_tool("tools/finetune.py", tiny_config_file, "--print-config", "--cfg-options",
                      "train.accumulate_steps=4", "data.train.resampled=true")
    assert result.returncode == 0, result.stderr
    printed = yaml.safe_load(result.stdout)
    assert printed == load_run_config(tiny_config_file, ["train.accumulate_steps=4",
                                                         "data.train.resampled=true"])
    assert printed["train"]["accumulate_steps"] == 4 and printed["train"]["sync_bn"] is False
    assert printed["data"]["train"]["resampled"] is True
    assert not (tmp_path / "work_dirs").exists() and not (ROOT / "work_dirs" / "tiny").exists()


def test_make_synthetic_cli(tmp_path):
    result = run_tool("tools/make_synthetic.py", "--out", tmp_path, "--train", "10", "--val",
                      "0", "--test", "4", "--shard-size", "4", "--flickr-entities")
    assert result.returncode == 0, result.stderr
    assert "train: 10 images, 50 captions, 3 shard(s)" in result.stdout
    assert len(list((tmp_path / "flickr30k_entities" / "Sentences").iterdir())) == 14
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert set(meta["splits"]) == {"train", "test"}


def test_plot_weights(tmp_path, capsys):
    main = load_tool("plot-weights").main  # in this process: no interpreter start per case
    out = tmp_path / "w.png"
    assert main(["--set", "tau=1", "cir_offset=0", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["--set", "taux=1", "--out", str(out)]) == 2
    assert "taux: not an option of any GOAL weight (did you mean tau?)" in capsys.readouterr().err
    assert main([str(ROOT / "configs/goal/quickstart_goal.yaml"), "--cfg-options",
                 "objective.triplet={'type': 'con', 'tau': 5}", "--out", str(out)]) == 2
    assert "'con' got unknown config key(s) 'tau'; it accepts: margin" in \
        capsys.readouterr().err
    # a lam: auto pair weight is drawn at its lam_init
    assert main([str(ROOT / "configs/goal/quickstart_goal_auto_lam.yaml"), "--out",
                 str(out)]) == 0


def test_sweep_rejects_options_before_training(tiny_benchmark, tmp_path, capsys):
    out, _ = tiny_benchmark
    config = tmp_path / "sweep.yaml"
    config.write_text(yaml.safe_dump(tiny_overrides("goal/sweep_synthetic.yaml", out)))
    sweep = tmp_path / "sweep"
    main = load_tool("sweep").main  # in this process: each case is refused before training
    # margin is con's option: swept with nca too it would be ignored there, so it is refused
    assert main([str(config), "--triplet", "con", "nca", "--pair", "con", "--grid",
                 "objective.triplet.margin=0.1,0.3", "--out", str(sweep)]) == 2
    assert ("ncaxcon margin=0.1: objective.triplet: triplet weight 'nca' got unknown config "
            "key(s) 'margin'; it accepts: tau") in capsys.readouterr().err
    assert main([str(config), "--grid", "objective.tau=1,5", "--out", str(sweep)]) == 2
    assert "--grid objective.triplet.tau=..." in capsys.readouterr().err
    # a seed's missing load_from checkpoint stops the sweep before the first seed trains
    missing = tmp_path / "runs" / "seed{seed}.pt"
    (tmp_path / "runs").mkdir()
    torch.save({}, tmp_path / "runs" / "seed0.pt")
    assert main([str(config), "--triplet", "con", "--pair", "con", "--seeds", "2",
                 "--cfg-options", f"load_from={missing}", "--out", str(sweep)]) == 2
    assert f"load_from {tmp_path / 'runs' / 'seed1.pt'} (seed 1) does not exist" in \
        capsys.readouterr().err
    assert not sweep.exists() or not any(sweep.iterdir())


def test_sweep_does_not_reuse_a_report_without_the_config_it_ran(tiny_benchmark, tmp_path):
    out, _ = tiny_benchmark
    config = tmp_path / "sweep.yaml"
    config.write_text(yaml.safe_dump(tiny_overrides("goal/sweep_synthetic.yaml", out)))
    run = tmp_path / "cell"
    run.mkdir()
    (run / "report.json").write_text(json.dumps({"test": {"rsum": 600.0}}))
    with pytest.raises(ValueError, match=r"holds a report.json but no config.yaml, so whether "
                                         r"it ran this config is unknown"):
        load_tool("sweep").run_one(str(config), [], 0, run)


def test_a_sweep_cell_refuses_what_train_refuses(tiny_benchmark, tmp_path):
    """Every cell starts through the one start function (mmgoal/runs/start.py): a folder
    holding an unfinished run without a checkpoint, a link among its files, a COCO
    protocol without the test shards' ids are refused before anything trains, as
    mmgoal train refuses them (sweep trained over the first two before)."""
    out, _ = tiny_benchmark
    config = tmp_path / "sweep.yaml"
    config.write_text(yaml.safe_dump(tiny_overrides("goal/sweep_synthetic.yaml", out)))
    run_one = load_tool("sweep").run_one
    cell = tmp_path / "cell"
    cell.mkdir()
    (cell / "metrics.jsonl").write_text('{"type": "train", "step": 1}\n')
    with pytest.raises(ValueError, match=rf"--work-dir {cell} already holds a run "
                                         rf"\(metrics.jsonl\); it has no checkpoint to "
                                         rf"resume: start afresh with --overwrite"):
        run_one(str(config), [], 0, cell)
    (cell / "metrics.jsonl").unlink()
    (cell / "metrics.jsonl").symlink_to(tmp_path / "yours.txt")
    with pytest.raises(ValueError, match=rf"{cell / 'metrics.jsonl'} is a symbolic link"):
        run_one(str(config), [], 0, cell)
    pytest.importorskip("eccv_caption")
    with pytest.raises(ValueError, match=r"scores the test split by COCO caption ids, and .* "
                                         r"has none"):
        run_one(str(config), ["evaluation.protocols=[coco,cxc]"], 0, tmp_path / "coco")
    assert not (tmp_path / "coco" / "checkpoints").exists()  # refused before the epochs


def test_sweep_fills_the_seed_into_load_from():
    sweep = load_tool("sweep")
    cfg = sweep.seeded_config("configs/goal/finetune_synthetic.yaml", ["objective.pair=sig_ms"], 2)
    assert cfg["load_from"] == (
        "work_dirs/fidelity/scratch/conxcon/default/seed2/checkpoints/best.pt")
    assert cfg["train"]["seed"] == 2 and cfg["objective"]["pair"] == "sig_ms"
    assert sweep.seeded_config("configs/goal/sweep_synthetic.yaml", [], 1).get("load_from") is None


@pytest.mark.slow
def test_sweep_tabulates_and_resumes(tiny_benchmark, tmp_path):
    out, _ = tiny_benchmark
    cfg = tiny_overrides(
        "goal/sweep_synthetic.yaml", out, train={"epochs": 2},
        hooks=[{"type": "ObjectiveWarmup", "epochs": 1,
                "objective": {"type": "TripletLoss", "max_violation": False}}])
    config = tmp_path / "sweep.yaml"
    config.write_text(yaml.safe_dump(cfg))
    sweep = tmp_path / "sweep"
    args = ("tools/sweep.py", config, "--triplet", "con", "--pair", "con", "lin", "--seeds", "2",
            "--grid", "objective.triplet.margin=0.1,0.3", "--out", sweep)
    result = run_tool(*args)
    assert result.returncode == 0, result.stderr
    runs = json.loads((sweep / "runs.json").read_text())
    assert len(runs) == 2 * 2 * 2
    assert {r["point"] for r in runs} == {"margin=0.1", "margin=0.3"}
    saved = yaml.safe_load((Path(runs[-1]["dir"]) / "config.yaml").read_text())["objective"]
    assert saved["triplet"] == {"type": "con", "margin": 0.3} and saved["pair"] == {"type": "lin"}
    table = (sweep / "table.md").read_text()
    assert "| pair \\ triplet | con |" in table
    # each cell: mean ± std over the 2 seeds of the grid point with the best validation rsum
    for pair in ("con", "lin"):
        cell = next(line for line in table.splitlines() if line.startswith(f"| {pair} |"))
        cell_runs = [r for r in runs if r["pair"] == pair]
        points = {p: [r for r in cell_runs if r["point"] == p]
                  for p in ("margin=0.1", "margin=0.3")}
        best = max(points, key=lambda p: sum(r["val_rsum"] for r in points[p]))
        i2t = [r["test"]["i2t_r1"] for r in points[best]]
        assert f"{sum(i2t) / 2:.1f} ±" in cell and f"({best})" in cell
    # a finished sweep is not trained again; a run without its report is resumed
    first = runs[0]
    (Path(first["dir"]) / "report.json").unlink()
    result = run_tool(*args)
    assert result.returncode == 0, result.stderr
    again = json.loads((sweep / "runs.json").read_text())
    assert again[0]["test"] == first["test"]
    assert all(a["train_seconds"] == b["train_seconds"] for a, b in zip(again[1:], runs[1:]))
    # other options: a finished cell is not reused for them, nor a started one resumed
    other = run_tool(*args, "--cfg-options", "model.embed_dim=8")
    assert other.returncode == 2
    assert ("holds a finished run of another config (model.embed_dim: 16 -> 8); its result is "
            "not reused for this one") in other.stderr
    (Path(first["dir"]) / "report.json").unlink()
    other = run_tool(*args, "--cfg-options", "model.embed_dim=8")
    assert other.returncode == 2
    assert "--resume: the config differs from the one" in other.stderr
    assert "model.embed_dim: 16 -> 8" in other.stderr
    saved = yaml.safe_load((Path(first["dir"]) / "config.yaml").read_text())
    assert saved["model"]["embed_dim"] == 16  # the run and its config are untouched


@pytest.mark.slow
def test_scan_cli_ensemble_attention_and_plot(tiny_benchmark, tmp_path):
    out, _ = tiny_benchmark
    cfg = tiny_overrides("scan/scan_synthetic.yaml", out,
                         train={"epochs": 1, "progress": False}, hooks=[],
                         constraints=[{"type": "CCRConstraint"}])
    path = tmp_path / "scan.yaml"
    path.write_text(yaml.safe_dump(cfg))
    work = tmp_path / "run"
    result = run_tool("tools/finetune.py", path, "--work-dir", work)
    assert result.returncode == 0, result.stderr
    report = json.loads((work / "report.json").read_text())
    best = work / "checkpoints" / "best.pt"
    # An ensemble of a checkpoint with itself scores like the checkpoint.
    result = run_tool("tools/evaluate.py", path, best, "--ensemble", best, "--attention",
                      "--out", tmp_path / "eval.json", "--curve", tmp_path / "pr.png")
    assert result.returncode == 0, result.stderr
    evaluated = json.loads((tmp_path / "eval.json").read_text())
    assert evaluated["metrics"]["rsum"] == pytest.approx(report["test"]["rsum"])
    best_f1 = evaluated["attention"]["best"]
    assert f"best F1 {best_f1['f1']:.4f}" in result.stdout
    assert len(evaluated["attention"]["curve"]) == 11 and (tmp_path / "pr.png").stat().st_size
    # The same ground truth as Flickr30K Entities files, joined by image id.
    from mmgoal.data.synthetic import iter_scenes, write_flickr_entities

    write_flickr_entities(list(iter_scenes("test", 40, seed=3, image_size=32)),
                          tmp_path / "entities")
    result = run_tool("tools/evaluate.py", path, best, "--attention", "--entities",
                      tmp_path / "entities", "--out", tmp_path / "eval_entities.json")
    assert result.returncode == 0, result.stderr
    from_files = json.loads((tmp_path / "eval_entities.json").read_text())["attention"]
    assert from_files["phrases"] == evaluated["attention"]["phrases"] > 0
    assert from_files["best"]["f1"] == pytest.approx(best_f1["f1"], abs=0.02)
    result = run_tool("tools/plot_attention.py", path, best, "--index", "2", "--word", "1",
                      "--out", tmp_path / "att.png")
    assert result.returncode == 0, result.stderr
    assert "written to" in result.stdout and (tmp_path / "att.png").stat().st_size > 1000
    result = run_tool("tools/plot_attention.py", path, best, "--word", "zebra")
    assert result.returncode == 2 and "is not in the caption" in result.stderr
    # Attention metrics need a cross-attention model.
    result = run_tool("tools/evaluate.py", path, best, "--entities", tmp_path / "nowhere")
    assert result.returncode == 2 and "no Sentences/ folder" in result.stderr


def test_evaluate_never_writes_its_json_over_a_runs_files(tiny_quickstart_run, tmp_path, capsys):
    source, _ = tiny_quickstart_run
    run = tmp_path / "run"
    shutil.copytree(source, run)
    evaluate = load_tool("eval")
    for own in ("checkpoints/last.pt", "checkpoints/best.pt", "config.yaml", "report.json"):
        before = (run / own).read_bytes()
        assert evaluate.main([str(run), "--device", "cpu", "--out", str(run / own)]) == 2
        assert (f"--out {run / own} exists and is not an earlier evaluation's JSON"
                in capsys.readouterr().err)
        assert (run / own).read_bytes() == before
    out = tmp_path / "test.json"
    assert evaluate.main([str(run), "--device", "cpu", "--out", str(out)]) == 0
    first = json.loads(out.read_text())
    assert evaluate.main([str(run), "--device", "cpu", "--out", str(out)]) == 0  # its own: fine
    assert json.loads(out.read_text())["metrics"] == first["metrics"]



def test_eval_results_are_named_by_the_data_evaluated(tiny_quickstart_run, tmp_path, capsys):
    from mmgoal.data.classification import write_synthetic_classification

    source, data = tiny_quickstart_run
    run = shutil.copytree(source, tmp_path / "run")
    evaluate = load_tool("eval")
    assert evaluate.main([str(run), "--device", "cpu"]) == 0
    own = (run / "eval_test.json").read_bytes()
    assert json.loads(own)["shards"] == f"{data}/test-{{000000..000001}}.tar"
    # other shards: a file of their own, the run's test result kept
    val = str(data / "val-000000.tar")
    assert evaluate.main([str(run), "--device", "cpu", "--shards", val]) == 0
    assert (run / "eval_test.json").read_bytes() == own
    other = [p.name for p in run.glob("eval_test_*.json")]
    assert len(other) == 1 and re.fullmatch(rf"eval_test_{data.name}_val-[0-9a-f]{{8}}\.json",
                                            other[0]), other
    assert json.loads((run / other[0]).read_text())["shards"] == [val]
    assert f"metrics written to {run / other[0]}" in capsys.readouterr().out
    # the run's own test shards, named one by one: its own result again
    (run / "eval_test.json").unlink()
    assert evaluate.main([str(run), "--device", "cpu", "--shards",
                          *(str(data / f"test-00000{i}.tar") for i in (0, 1))]) == 0
    assert json.loads((run / "eval_test.json").read_text())["metrics"] == \
        json.loads(own)["metrics"]
    own = (run / "eval_test.json").read_bytes()
    # other files of the same names and sizes (tars grow in 10 KiB records), through
    # --shards or --cfg-options: named apart
    copy = tmp_path / "copy"
    copy.mkdir()
    for i in (0, 1):
        shard = bytearray((data / f"test-00000{i}.tar").read_bytes())
        shard[600] ^= 0xFF  # a byte of the first sample's first member
        (copy / f"test-00000{i}.tar").write_bytes(shard)
    pattern = str(copy / "test-{000000..000001}.tar")
    assert evaluate.main([str(run), "--device", "cpu", "--shards", pattern]) == 0
    assert evaluate.main([str(run), "--device", "cpu", "--cfg-options",
                          f"data.test.shards={pattern}"]) == 0
    assert (run / "eval_test.json").read_bytes() == own
    [copied] = run.glob("eval_test_copy_test-*.json")  # both: the same set
    # zero-shot alone records the classification set's root and split
    write_synthetic_classification(tmp_path / "shapes", count=12, image_size=32)
    assert evaluate.main([str(run), "--device", "cpu", "--zeroshot", str(tmp_path / "shapes"),
                          "--no-retrieval"]) == 0
    [zeroshot] = run.glob("eval_zeroshot_*.json")
    assert re.fullmatch(r"eval_zeroshot_shapes_test-[0-9a-f]{8}\.json", zeroshot.name)
    result = json.loads(zeroshot.read_text())
    assert result["split"] == "test" and result["metrics"]["zeroshot_images"] == 12
    assert result["zeroshot"] == {"root": str(tmp_path / "shapes"), "split": "test"}
    assert sorted(p.name for p in run.glob("eval_*.json")) == sorted(
        ["eval_test.json", other[0], copied.name, zeroshot.name])

def test_a_full_disk_stops_training_with_a_sentence(tiny_config_file, tmp_path, capsys,
                                                    monkeypatch):
    import errno

    from mmgoal.runs import checkpoint

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", disk_full)
    run = tmp_path / "run"
    finetune = load_tool("train")
    assert finetune.main([str(tiny_config_file), "--work-dir", str(run), "--cfg-options",
                          "train.epochs=1"]) == 1
    err = capsys.readouterr().err
    assert f"error: could not write {run / 'checkpoints'}" in err
    assert "(No space left on device); nothing was written" in err and "--resume" in err
    assert not list((run / "checkpoints").glob(".*.tmp-*"))


@pytest.mark.slow
@pytest.mark.parametrize("signals", [("SIGINT", "SIGINT"), ("SIGTERM",)])
def test_a_signalled_sweep_ends_with_130_and_a_sentence(tiny_benchmark, tmp_path, signals):
    import signal
    import time

    out, _ = tiny_benchmark
    config = tmp_path / "sweep.yaml"
    config.write_text(yaml.safe_dump(tiny_overrides("goal/sweep_synthetic.yaml", out,
                                                    train={"epochs": 50, "log_every": 1})))
    sweep = tmp_path / "sweep"
    process = subprocess.Popen(
        [sys.executable, "tools/sweep.py", str(config), "--triplet", "con", "--pair", "con",
         "--seeds", "1", "--out", str(sweep)], cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    metrics = sweep / "conxcon" / "default" / "seed0" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.is_file() and metrics.read_text()) and time.monotonic() < deadline:
        time.sleep(0.2)  # training has taken a step
    for name in signals:
        process.send_signal(getattr(signal, name))
        time.sleep(0.3)
    _, err = process.communicate(timeout=300)
    assert process.returncode == 130, err
    assert "Traceback" not in err
    assert "interrupted; the same command continues the sweep" in err
