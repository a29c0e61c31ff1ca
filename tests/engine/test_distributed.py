"""Two processes on CPU (gloo) train exactly like one, under torchrun and deepspeed.

Every run here is the quickstart model (group norm, so per-rank batch statistics
do not differ from the global batch's) with the GOAL objective, fed by
``GlobalBatchSlices`` (distributed_fixtures.py): rank r of 2 gets the r-th half
of the very global batches that a single process with twice the batch sees.
"""

import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from ranks import free_port  # tests/ranks.py

from mmgoal.runs.checkpoint import load_checkpoint
from mmgoal.runs.run_dir import CHANGES_FILE, LATEST, read_pointer

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PER_RANK = 8
STEPS = 20  # 160 images, global batch 16: 10 steps per epoch, 2 epochs

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def environment() -> dict:
    return {**os.environ, "PYTHONPATH": f"{Path(__file__).parent}{os.pathsep}{ROOT}",
            "HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
            "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR",
                                                   str(BIN.parent / "torch_extensions"))}


def launch(launcher: str, config: Path, work_dir: Path, *extra: str,
           timeout: int = 300) -> subprocess.CompletedProcess:
    """Train under ``torchrun``/``deepspeed``/``accelerate`` with 2 processes, or alone, in
    the forms docs/distributed.md gives: the launchers start the module (``-m mmgoal
    train``; the deepspeed launcher puts ``--local_rank=N`` before ``train``), one process
    runs the repository's tools/finetune.py."""
    train = ["mmgoal", "train", str(config), "--work-dir", str(work_dir), *extra]
    command = {
        "single": [sys.executable, str(ROOT / "tools" / "finetune.py"), *train[2:]],
        "torchrun": [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", "-m",
                     *train],
        "deepspeed": [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port",
                      str(free_port()), "--module", *train],
        # --multi_gpu is accelerate's multi-process switch; on CPU the strategy makes it gloo
        "accelerate": [str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2",
                       "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend",
                       "no", "--main_process_port", str(free_port()), "-m", *train],
    }[launcher]
    # A session of its own: KillAllAt kills the launcher's whole process group.
    return subprocess.run(command, cwd=ROOT, env=environment(), capture_output=True, text=True,
                          timeout=timeout, start_new_session=True)


def write_config(path: Path, data: Path, batch: int, **top) -> Path:
    cfg = {
        "_base_": str(ROOT / "configs" / "quickstart.yaml"),
        "custom_imports": ["distributed_fixtures"],
        "model": {"embed_dim": 16,
                  "image_encoder": {"model_kwargs": {"widths": [8, 16], "norm": "group"}},
                  "text_encoder": {"word_dim": 8, "hidden_size": 16}},
        "objective": {"_delete_": True, "type": "GoalObjective", "triplet": "cir",
                      "pair": "sig_ms"},
        "hooks": [],
        "optimizer": {"lr": 3e-3},
        "schedule": {"warmup_steps": 2},
        "data": {"image_size": 32, "num_workers": 0,
                 "train": {"_delete_": True, "type": "GlobalBatchSlices",
                           "shards": str(data / "train-{000000..000003}.tar"),
                           "batch_size": batch},
                 "val": {"shards": str(data / "val-000000.tar")},
                 "test": {"shards": str(data / "test-000000.tar")}},
        "train": {"epochs": 2, "log_every": 5, "progress": False},
    }
    for key, value in top.items():
        merge = isinstance(value, dict) and not value.get("_delete_")
        cfg[key] = {**cfg.get(key, {}), **value} if merge else value
    path.write_text(yaml.safe_dump(cfg))
    return path


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    """The model weights at the end of a run, whatever strategy wrote it."""
    tag = read_pointer(run / "checkpoints" / "deepspeed" / LATEST)
    path = (run / "checkpoints" / "deepspeed" / tag / "weights.pt" if tag
            else run / "checkpoints" / "last.pt")
    return load_checkpoint(path)["model"]


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The data, configs, the one-process reference and the 2-rank DeepSpeed ZeRO-2 run."""
    from mmgoal.data.synthetic import write_benchmark

    root = tmp_path_factory.mktemp("distributed")
    data = root / "data"
    write_benchmark(data, {"train": 160, "val": 32, "test": 40}, seed=3, image_size=32,
                    shard_size=40, progress=False)
    configs = {"single": write_config(root / "single.yaml", data, 2 * PER_RANK),
               "ranks": write_config(root / "ranks.yaml", data, PER_RANK)}
    ok(launch("single", configs["single"], root / "single"))
    ok(launch("deepspeed", configs["ranks"], root / "zero2", "--deepspeed"))
    return root, data, configs


def test_deepspeed_zero2_on_two_ranks_trains_like_one_process(setup):
    root, _, _ = setup
    single, zero2 = final_weights(root / "single"), final_weights(root / "zero2")
    assert max_difference(single, zero2) < 1e-5
    state = load_checkpoint(next((root / "zero2" / "checkpoints" / "deepspeed").glob(
        "*/trainer_state.pt")))
    assert state["step"] == STEPS and state["world_size"] == 2 and len(state["rng"]) == 2
    # rank 0 alone logs: one record per logged step, not two
    records = [json.loads(line) for line in
               (root / "zero2" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["type"] == "train"] == [5, 10, 15, 20]
    assert [r["type"] for r in records].count("val") == 2
    # and it wrote the report; weights equal to 1e-7 may still break a tie in a rank
    reports = [json.loads((root / run / "report.json").read_text()) for run in ("single", "zero2")]
    assert reports[1]["test"] == pytest.approx(reports[0]["test"], abs=0.1)


def test_ddp_with_grad_cache_trains_like_one_process_and_resumes_exactly(setup, tmp_path):
    """torch DDP under torchrun with local scoring (GOAL's rows) and gradient caching (each
    rank's 8 pairs encoded 3 at a time): the one-process run's weights; stopped by SIGTERM
    and resumed, bit for bit the uninterrupted run's."""
    root, data, _ = setup
    train = {"epochs": 2, "log_every": 5, "progress": False, "grad_cache_chunk": 3}
    cached = write_config(tmp_path / "cached.yaml", data, PER_RANK, train=train)
    result = ok(launch("torchrun", cached, tmp_path / "ddp"))
    assert "global batch 16 = 8 per rank x 2 rank(s) x 1 accumulation step(s)" in result.stderr
    assert "works on the whole score matrix" not in result.stderr  # GOAL scored its rows
    assert max_difference(final_weights(root / "single"), final_weights(tmp_path / "ddp")) < 1e-5
    stopping = write_config(tmp_path / "stop.yaml", data, PER_RANK, train=train,
                            hooks=[{"type": "SignalLauncherAt", "step": 7}])
    run = tmp_path / "run"
    result = launch("torchrun", stopping, run)
    assert result.returncode != 0 and "stopping after this step" in result.stderr
    assert 7 <= load_checkpoint(run / "checkpoints" / "last.pt")["step"] < STEPS
    ok(launch("torchrun", stopping, run, "--resume"))
    resumed, uninterrupted = final_weights(run), final_weights(tmp_path / "ddp")
    assert all(torch.equal(resumed[name], uninterrupted[name]) for name in uninterrupted)


# One launch per behaviour of mmgoal's code: stages 0-2 share its path (ZeRO-2 is the
# module's reference run), stage 3 partitions the parameters (their gather for evaluation
# and checkpoints), bf16 changes the precision.
@pytest.mark.parametrize("zero_config,tolerance", [
    ({"zero_optimization": {"stage": 3}}, 1e-5),
    ({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}, None),
])
def test_zero_stages_and_bf16_agree(setup, tmp_path, zero_config, tolerance):
    root, _, configs = setup
    ds_json = tmp_path / "ds.json"
    ds_json.write_text(json.dumps({**zero_config, "train_micro_batch_size_per_gpu": "auto"}))
    ok(launch("torchrun", configs["ranks"], tmp_path / "run", "--deepspeed", str(ds_json)))
    reference, weights = final_weights(root / "zero2"), final_weights(tmp_path / "run")
    if tolerance is not None:
        assert max_difference(reference, weights) < tolerance
        return
    # bf16 products: the training path differs at bf16's precision (8 bits) from the
    # first step on; after 20 Adam steps the updates still point the same way.
    initial = initial_weights(configs["ranks"], root / "zero2")
    flat = {name: torch.cat([w[k].float().flatten() for k in sorted(reference)])
            for name, w in (("fp32", reference), ("bf16", weights), ("init", initial))}
    fp32_update, bf16_update = flat["fp32"] - flat["init"], flat["bf16"] - flat["init"]
    assert torch.nn.functional.cosine_similarity(fp32_update, bf16_update, dim=0) > 0.9
    assert (bf16_update - fp32_update).norm() < 0.5 * fp32_update.norm()


def initial_weights(config: Path, run: Path) -> dict[str, torch.Tensor]:
    """The model a run starts from: its seed, its vocabulary, nothing trained."""
    from mmgoal.config import load_config
    from mmgoal.registry import MODELS, TOKENIZERS

    cfg = load_config(str(config))
    torch.manual_seed(cfg["train"]["seed"])
    tokenizer = TOKENIZERS.build(cfg["data"]["tokenizer"])
    tokenizer.load_state_dict(load_checkpoint(run / "checkpoints" / "best.pt")["tokenizer"])
    model = MODELS.build(cfg["model"], tokenizer=tokenizer)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_sigterm_stops_every_rank_and_the_run_resumes_exactly(setup, tmp_path):
    root, data, configs = setup
    stopping = write_config(tmp_path / "stop.yaml", data, PER_RANK,
                            hooks=[{"type": "SignalLauncherAt", "step": 7}])
    run = tmp_path / "run"
    result = launch("torchrun", stopping, run, "--deepspeed")
    assert result.returncode != 0 and "stopping after this step" in result.stderr
    stopped = load_checkpoint(next(run.glob("checkpoints/deepspeed/*/trainer_state.pt")))
    assert 7 <= stopped["step"] < STEPS and not (run / "report.json").exists()
    # a resume keeps the run's config: another model is refused, the run untouched
    result = launch("torchrun", configs["ranks"], run, "--deepspeed", "--resume",
                    "--cfg-options", "model.embed_dim=8")
    assert result.returncode != 0 and "model.embed_dim: 16 -> 8" in result.stderr
    assert "hooks" in result.stderr  # the stopping hook is part of the run's config too
    shutil.copytree(run, tmp_path / "one")
    ok(launch("torchrun", stopping, run, "--deepspeed", "--resume"))
    assert max_difference(final_weights(root / "zero2"), final_weights(run)) < 1e-6
    # the same checkpoint resumed by one process with the same global batch (the per-rank
    # batch may change on resume; the product is checked)
    result = launch("single", stopping, tmp_path / "one", "--deepspeed", "--resume")
    assert result.returncode == 2 and "global batch of 16; this run gives 8" in result.stderr
    result = ok(launch("single", stopping, tmp_path / "one", "--deepspeed", "--resume",
                       "--cfg-options", f"data.train.batch_size={2 * PER_RANK}"))
    changes = [json.loads(line) for line in (tmp_path / "one" / CHANGES_FILE).open()]
    assert [c["changes"] for c in changes] == [
        {"data.train.batch_size": [PER_RANK, 2 * PER_RANK]}]
    assert "universal checkpoint" in result.stderr
    assert max_difference(final_weights(root / "zero2"), final_weights(tmp_path / "one")) < 1e-5


def test_a_sigkilled_run_resumes_from_its_last_checkpoint(setup, tmp_path):
    root, data, configs = setup
    killed = write_config(tmp_path / "kill.yaml", data, PER_RANK,
                          hooks=[{"type": "KillAllAt", "step": 13}],
                          train={"epochs": 2, "log_every": 5, "progress": False,
                                 "checkpoint_every_steps": 5})
    run = tmp_path / "run"
    result = launch("torchrun", killed, run, "--deepspeed")
    assert result.returncode != 0
    tag = read_pointer(run / "checkpoints" / "deepspeed" / LATEST)
    killed_state = load_checkpoint(run / "checkpoints" / "deepspeed" / tag / "trainer_state.pt")
    assert killed_state["step"] == 10
    ok(launch("torchrun", killed, run, "--deepspeed", "--resume"))
    records = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    steps = [r["step"] for r in records if r["type"] == "train"]
    assert steps == sorted(set(steps)), "steps 11-13 logged twice after the resume"
    report = json.loads((run / "report.json").read_text())
    assert report["train_seconds"] > killed_state["train_seconds"] > 0  # carried over
    assert max_difference(final_weights(root / "zero2"), final_weights(run)) < 1e-6


def test_two_rank_checkpoint_is_exported_and_evaluated_by_one_process(setup, tmp_path):
    root, _, configs = setup
    # an unfinished newer checkpoint (a save killed halfway) is not what `latest` names
    unfinished = root / "zero2" / "checkpoints" / "deepspeed" / "epoch0009-step000000099"
    unfinished.mkdir(exist_ok=True)
    (unfinished / "mp_rank_00_model_states.pt").write_bytes(b"half a file")
    exported = tmp_path / "zero2.pt"
    ok(subprocess.run([sys.executable, "tools/export.py", str(root / "zero2"), "--latest", "--out",
                       str(exported)], cwd=ROOT, env=environment(), capture_output=True,
                      text=True, timeout=120))
    assert max_difference(torch.load(exported, weights_only=True)["model"],
                          final_weights(root / "single")) < 1e-5
    results = []
    for checkpoint in (exported, root / "single" / "checkpoints" / "last.pt"):
        out = tmp_path / f"{checkpoint.stem}.json"
        # the config's own plug-in (its data set) is imported when asked for
        ok(subprocess.run([sys.executable, "tools/evaluate.py", str(configs["ranks"]),
                           str(checkpoint), "--out", str(out), "--trust-custom-imports"],
                          cwd=ROOT, env=environment(), capture_output=True, text=True,
                          timeout=120))
        results.append(json.loads(out.read_text()))
    assert results[0]["metrics"] == pytest.approx(results[1]["metrics"], abs=0.1)
    # the same evaluation spread over 2 ranks: each its share of the gallery, the metrics
    # of one process (tests/evaluation/test_distributed_eval.py: the matrices too)
    spread = tmp_path / "spread.json"
    ok(subprocess.run([str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", "-m",
                       "mmgoal", "eval", str(configs["ranks"]), str(exported), "--out",
                       str(spread), "--trust-custom-imports", "--device", "cpu"], cwd=ROOT,
                      env=environment(), capture_output=True, text=True, timeout=180))
    assert json.loads(spread.read_text())["metrics"] == pytest.approx(results[0]["metrics"],
                                                                      abs=1e-9)


def corrupt_shard_config(tmp_path: Path, data: Path, shards: list[Path]) -> Path:
    cfg = {
        "_base_": str(ROOT / "configs" / "quickstart.yaml"),
        "model": {"embed_dim": 16,
                  "image_encoder": {"model_kwargs": {"widths": [8, 16], "norm": "group"}},
                  "text_encoder": {"word_dim": 8, "hidden_size": 16}},
        "hooks": [],
        "data": {"image_size": 32, "num_workers": 0,
                 "train": {"shards": [str(s) for s in shards], "batch_size": 8},
                 "val": {"shards": str(data / "val-000000.tar")}, "test": None},
        "train": {"epochs": 1, "progress": False},
    }
    path = tmp_path / "corrupt.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_a_corrupt_shard_on_one_rank_does_not_hang_the_other(setup, tmp_path):
    _, data, _ = setup
    shards = sorted(Path(p) for p in glob.glob(str(data / "train-*.tar")))
    cut = tmp_path / "cut.tar"
    cut.write_bytes(shards[1].read_bytes()[: shards[1].stat().st_size // 2])
    config = corrupt_shard_config(tmp_path, data, [shards[0], cut, shards[2], shards[3]])
    ok(launch("torchrun", config, tmp_path / "cut", timeout=240))
    report = json.loads((tmp_path / "cut" / "report.json").read_text())
    assert report["steps"] >= 140 // 16  # an epoch of what the shards still hold
    # every shard of rank 1 unreadable: rank 1 says so and the launcher stops both
    garbage = tmp_path / "garbage.tar"
    garbage.write_bytes(b"not a tar file" * 1000)
    config = corrupt_shard_config(tmp_path, data, [shards[0], garbage])
    result = launch("torchrun", config, tmp_path / "garbage", timeout=240)
    assert result.returncode != 0
    assert "rank 1 worker 0 read a whole pass of its training shards" in result.stderr


def test_gradient_accumulation_matches_between_deepspeed_and_one_process(setup, tmp_path):
    """With lam: auto too: each micro-batch's gathered scores are the one process's, and
    lam, updated once a step from every micro-batch of every rank, is the same."""
    root, data, _ = setup
    train = {"epochs": 1, "log_every": 1, "progress": False, "accumulate_steps": 2}
    objective = {"_delete_": True, "type": "GoalObjective", "triplet": "cir",
                 "pair": {"type": "sig_ms", "lam": "auto", "lam_momentum": 0.5}}
    single = write_config(tmp_path / "single.yaml", data, 8, train=train, objective=objective)
    ranks = write_config(tmp_path / "ranks.yaml", data, 4, train=train, objective=objective)
    ok(launch("single", single, tmp_path / "single"))
    result = ok(launch("torchrun", ranks, tmp_path / "ranks", "--deepspeed"))
    assert "global batch 16 = 4 per rank x 2 rank(s) x 2 accumulation step(s)" in result.stderr
    assert max_difference(final_weights(tmp_path / "single"),
                          final_weights(tmp_path / "ranks")) < 1e-5
    lams = [[r["lam"] for r in map(json.loads, open(run / "metrics.jsonl")) if r["type"] == "train"]
            for run in (tmp_path / "single", tmp_path / "ranks")]
    assert len(lams[0]) == 10 and len(set(lams[0])) == 10
    assert lams[0] == pytest.approx(lams[1], abs=1e-6)


def test_a_nan_loss_on_one_rank_skips_the_step_on_every_rank(setup, tmp_path):
    _, data, _ = setup
    train = {"epochs": 1, "log_every": 1, "progress": False, "max_nonfinite_steps": 3}
    once = write_config(tmp_path / "once.yaml", data, PER_RANK, train=train,
                        objective={"_delete_": True, "type": "NaNOnOneRank", "first": 3})
    result = ok(launch("torchrun", once, tmp_path / "once", "--deepspeed"))
    assert "non-finite loss or gradient at step 2: step skipped" in result.stderr
    weights = final_weights(tmp_path / "once")
    assert all(torch.isfinite(w).all() for w in weights.values() if w.is_floating_point())
    steps = [json.loads(line) for line in (tmp_path / "once" / "metrics.jsonl").read_text()
             .splitlines() if '"train"' in line]
    assert [r["step"] for r in steps] == list(range(1, 11))
    # NaN on rank 1 for good: both ranks stop after 3 skipped steps, neither hangs
    always = write_config(tmp_path / "always.yaml", data, PER_RANK, train=train,
                          objective={"_delete_": True, "type": "NaNOnOneRank", "first": 3,
                                     "count": 100})
    result = launch("torchrun", always, tmp_path / "always", "--deepspeed", timeout=240)
    assert result.returncode != 0
    assert "3 non-finite losses in a row (step 4" in result.stderr


def test_accelerate_launch_trains_both_ranks_identically(setup, tmp_path):
    root, data, _ = setup
    config = write_config(tmp_path / "acc.yaml", data, PER_RANK,
                          strategy={"type": "accelerate"},
                          hooks=[{"type": "SaveRankWeights"}])
    result = ok(launch("accelerate", config, tmp_path / "acc"))
    assert "Accelerate MULTI_CPU (mixed precision no), 2 process(es)" in result.stderr
    ranks = [torch.load(tmp_path / "acc" / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert all(torch.equal(ranks[0][k], ranks[1][k]) for k in ranks[0])
    assert max_difference(final_weights(root / "single"), ranks[0]) < 1e-5


def test_ddp_accumulates_without_sync_and_rewraps_when_the_objective_changes(setup, tmp_path):
    """torch DDP with 2 accumulation steps and a warm-up objective that leaves InfoNCE's
    learnable temperature unused in epoch 0: the unused-parameter search stays on there and
    goes once the configured objective uses every parameter; weights equal one process."""
    _, data, _ = setup
    train = {"epochs": 2, "log_every": 5, "progress": False, "accumulate_steps": 2}
    top = {"train": train,
           "objective": {"_delete_": True, "type": "InfoNCELoss", "temperature": 0.1,
                         "learnable": True},
           "hooks": [{"type": "ObjectiveWarmup", "epochs": 1,
                      "objective": {"type": "TripletLoss", "margin": 0.2}}]}
    single = write_config(tmp_path / "single.yaml", data, 8, **top)
    ranks = write_config(tmp_path / "ranks.yaml", data, 4, **top)
    ok(launch("single", single, tmp_path / "single"))
    result = ok(launch("torchrun", ranks, tmp_path / "ranks"))
    assert "torch DDP on cpu, 2 process(es)" in result.stderr
    assert "1 trainable parameter(s) got no gradient in a step" in result.stderr
    single_state = load_checkpoint(tmp_path / "single" / "checkpoints" / "last.pt")
    ranks_state = load_checkpoint(tmp_path / "ranks" / "checkpoints" / "last.pt")
    assert max_difference(single_state["model"], ranks_state["model"]) < 1e-5
    temperature = [s["objective"]["temperature"] for s in (single_state, ranks_state)]
    assert torch.allclose(*temperature, atol=1e-6) and abs(float(temperature[0]) - 0.1) > 1e-4


def test_deepspeed_ranks_evaluate_the_gathered_weights_before_training(setup, tmp_path):
    """``train.eval_before_training`` under ZeRO-2 (both ranks evaluate their shares of the
    gallery, rank 0 the zero-shot set) logs what one process gives for the same initial
    weights, once; the ``no_decay`` groups train there too."""
    from mmgoal.data.classification import write_synthetic_classification

    _, data, _ = setup
    write_synthetic_classification(tmp_path / "shapes", count=24, image_size=32)
    top = {"train": {"epochs": 1, "log_every": 5, "progress": False,
                     "eval_before_training": True},
           "evaluation": {"zeroshot": {"root": str(tmp_path / "shapes")}},
           "optimizer": {"lr": 3e-3, "no_decay": ["bias", "norm", "vector"]}}
    ok(launch("deepspeed", write_config(tmp_path / "ranks.yaml", data, PER_RANK, **top),
              tmp_path / "zero2", "--deepspeed"))
    # one process, no epoch to train: the evaluation of the same initial weights alone (in
    # a process of its own: the config imports the test components)
    ok(launch("single", write_config(tmp_path / "one.yaml", data, 2 * PER_RANK, **top),
              tmp_path / "one", "--cfg-options", "train.epochs=0"))
    records, (one, *_) = ([json.loads(line) for line in
                           (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
                          for run in ("zero2", "one"))
    assert records[0] == one and one["epoch"] == -1 and one["type"] == "val"
    assert one["zeroshot_images"] == 24 and "zeroshot_top1" in one
    assert [r["epoch"] for r in records if r["type"] == "val"] == [-1, 0]


# The model families on score tiles: each shrunk, GOAL or its paper's objective, trained
# under torchrun with gradient caching (each rank's 8 pairs encoded 3 at a time)
FAMILIES = {
    "scan_ccr_ccs": {
        "_base_": str(ROOT / "configs" / "scan" / "scan_ccr_ccs_synthetic.yaml"),
        "model": {"embed_dim": 16,
                  "image_encoder": {"model_kwargs": {"widths": [8, 16], "norm": "group"}},
                  "text_encoder": {"word_dim": 8, "hidden_size": 16}},
        "objective": {"_delete_": True, "type": "GoalObjective", "triplet": "cir",
                      "pair": "sig_ms"}},
    "tiny_clip": {
        "_base_": str(ROOT / "configs" / "clip" / "clip_tiny_synthetic.yaml"),
        "model": {"model_kwargs": {
            "_delete_": True, "embed_dim": 16,
            "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 16,
                           "head_width": 16},
            "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2,
                         "layers": 1}}},
        # SGD: Adam would turn float rounding in near-zero gradients into lr-sized steps
        "optimizer": {"_delete_": True, "type": "SGD", "lr": 0.05, "weight_decay": 0.0}},
    "xvlm": {
        "_base_": str(ROOT / "configs" / "xvlm" / "xvlm_tiny_synthetic.yaml"),
        "model": {"vision": {"model_kwargs": {"img_size": 32, "patch_size": 16, "embed_dim": 32,
                                              "depth": 1, "num_heads": 2}},
                  "text": {"config": {"hidden_size": 32, "num_hidden_layers": 2,
                                      "num_attention_heads": 2, "intermediate_size": 64}},
                  "fusion_layers": 1, "embed_dim": 16},
        "evaluation": {"rerank_k": 4}},
}


def family_config(path: Path, data: Path, family: str, batch: int, **train) -> Path:
    cfg = {**FAMILIES[family], "custom_imports": ["distributed_fixtures"], "hooks": [],
           "data": {"image_size": 32, "num_workers": 0,
                    "train": {"_delete_": True, "type": "GlobalBatchSlices",
                              "shards": str(data / "train-{000000..000003}.tar"),
                              "batch_size": batch},
                    "val": None, "test": None},
           "train": {"epochs": 1, "log_every": 5, "progress": False, "grad_cache_chunk": 3,
                     "eval_before_training": False, **train}}
    if family == "tiny_clip":  # the model's own 32 px, without the training crops' draws
        cfg["data"].update(image_size=None, train_transforms=[
            {"type": "OpenCLIPTransform", "model_name": "ViT-B-32", "image_size": 32}])
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_model_family_trains_on_tiles_on_two_ranks_and_resumes_exactly(setup, tmp_path,
                                                                             family, strategy):
    """SCAN with CCR and CCS, a tiny CLIP and X-VLM (ITC + ITM) on score tiles under torchrun,
    with torch DDP or DeepSpeed ZeRO-2, and gradient caching: the CLIP's weights are one
    process's; stopped by SIGTERM and resumed, each is bit for bit the uninterrupted run.
    (CCR's query words and ITM's negatives are drawn by each rank, so those runs and one
    process draw apart; their sums over the ranks are one process's in
    tests/engine/test_local_scoring.py and tests/engine/test_itm_gather.py.)"""
    _, data, _ = setup
    flags = ("--deepspeed",) if strategy == "zero2" else ()
    ranks = family_config(tmp_path / "ranks.yaml", data, family, PER_RANK)
    result = ok(launch("torchrun", ranks, tmp_path / "ranks", *flags))
    assert "works on the whole score matrix" not in result.stderr
    if family == "tiny_clip":
        single = family_config(tmp_path / "single.yaml", data, family, 2 * PER_RANK,
                               grad_cache_chunk=None)
        ok(launch("single", single, tmp_path / "single"))
        assert max_difference(final_weights(tmp_path / "single"),
                              final_weights(tmp_path / "ranks")) < 1e-5
    stopping = family_config(tmp_path / "stop.yaml", data, family, PER_RANK)
    cfg = yaml.safe_load(stopping.read_text())
    stopping.write_text(yaml.safe_dump({**cfg, "hooks": [{"type": "SignalLauncherAt",
                                                          "step": 5}]}))
    run = tmp_path / "run"
    result = launch("torchrun", stopping, run, *flags)
    assert result.returncode != 0 and "stopping after this step" in result.stderr
    ok(launch("torchrun", stopping, run, "--resume", *flags))
    resumed, uninterrupted = final_weights(run), final_weights(tmp_path / "ranks")
    assert max_difference(resumed, uninterrupted) == 0.0
