"""Strategy choices and their mistakes, in one process."""

import json
import math

import pytest
import torch
import yaml
from script_modules import load_tool
from test_trainer import tiny_config

from mmgoal.engine.strategies.deepspeed import merge_deepspeed_config
from mmgoal.engine.trainer import Trainer
from mmgoal.registry import OBJECTIVES, STRATEGIES


def finetune_tool():
    return load_tool("train")


def test_deepspeed_config_takes_the_json_first_and_mmgoal_values_for_the_rest():
    merged = merge_deepspeed_config(
        {"train_micro_batch_size_per_gpu": "auto", "gradient_clipping": 1.0,
         "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}},
        micro_batch=8, accumulate_steps=2, world_size=4, clip_grad=2.0, zero_stage=3,
        precision="bf16")
    assert merged["train_micro_batch_size_per_gpu"] == 8
    assert merged["gradient_accumulation_steps"] == 2
    assert merged["train_batch_size"] == 64  # 8 per rank x 2 accumulation x 4 ranks
    assert merged["gradient_clipping"] == 1.0  # the JSON's own
    assert merged["zero_optimization"] == {"stage": 3}
    assert merged["bf16"] == {"enabled": True} and "fp16" not in merged
    assert merged["optimizer"]["params"]["lr"] == 1e-4
    plain = merge_deepspeed_config({}, micro_batch=8, accumulate_steps=1, world_size=1,
                                   clip_grad=None, zero_stage=0, precision="fp32")
    assert plain["gradient_clipping"] == 0.0 and "bf16" not in plain


def test_a_deepspeed_batch_size_against_the_mmgoal_config_is_an_error():
    with pytest.raises(ValueError, match=r"sets train_batch_size=128, but the mmgoal config "
                                         r"gives 32 .*2 ranks.*\"auto\""):
        merge_deepspeed_config({"train_batch_size": 128}, micro_batch=16, accumulate_steps=1,
                               world_size=2, clip_grad=None, zero_stage=2, precision="fp32")


def test_strategy_mistakes_say_what_to_do():
    with pytest.raises(ValueError, match="zero_stage must be 0, 1, 2 or 3, got 4"):
        STRATEGIES.build({"type": "deepspeed", "zero_stage": 4})
    with pytest.raises(ValueError, match="precision must be fp32, bf16 or fp16, got 'fp8'"):
        STRATEGIES.build({"type": "deepspeed", "precision": "fp8"})
    for strategy in ("deepspeed", "torch"):
        with pytest.raises(ValueError, match="fp16 trains on GPUs only.*on the CPU use bf16 or "
                                             "fp32"):
            STRATEGIES.build({"type": strategy, "precision": "fp16", "device": "cpu"})
    with pytest.raises(FileNotFoundError, match="DeepSpeed config .*missing.json does not exist"):
        STRATEGIES.build({"type": "deepspeed", "config": "missing.json"})
    with pytest.raises(ValueError, match="find_unused_parameters must be true or false or auto, "
                                         "got 'sometimes'"):
        STRATEGIES.build({"type": "ddp", "find_unused_parameters": "sometimes"})


def test_deepspeed_flag_sets_the_strategy_and_keeps_its_settings():
    tool = finetune_tool()
    args = tool.parse_args(["c.yaml", "--deepspeed", "ds.json", "--local_rank=1"])
    assert args.deepspeed == "ds.json" and args.local_rank == 1
    assert tool.parse_args(["c.yaml", "--deepspeed"]).deepspeed is True
    assert tool.parse_args(["c.yaml"]).deepspeed is None
    cfg = {"model": {}, "strategy": {"type": "deepspeed", "zero_stage": 3}}
    assert tool.with_deepspeed(cfg, True)["strategy"] == {"type": "deepspeed", "zero_stage": 3}
    assert tool.with_deepspeed({"strategy": {"type": "ddp"}}, "ds.json")["strategy"] == {
        "type": "deepspeed", "config": "ds.json"}


@pytest.mark.parametrize("rule,factor", [("none", 1.0), ("linear", 3.0), ("sqrt", math.sqrt(3))])
def test_learning_rate_scales_with_the_global_batch(tiny_benchmark, tmp_path, rule, factor):
    out, _ = tiny_benchmark
    cfg = tiny_config(out, scale_lr=rule, reference_batch=4)  # batch 12 in one process
    cfg["data"]["train"]["batch_size"] = 12
    trainer = Trainer(cfg, tmp_path / rule)
    assert trainer.global_batch == 12
    assert trainer.base_lrs[0] == pytest.approx(3e-3 * factor)
    cfg = tiny_config(out, scale_lr="quadratic")
    with pytest.raises(ValueError, match="scale_lr must be none, linear or sqrt, got .quadratic."):
        Trainer(cfg, tmp_path / "bad")


def test_accumulation_counts_steps_over_micro_batches(tiny_benchmark, tmp_path):
    out, _ = tiny_benchmark
    cfg = tiny_config(out, epochs=1, accumulate_steps=2, log_every=1)
    trainer = Trainer(cfg, tmp_path / "acc")
    assert trainer.global_batch == 32 and trainer.steps_per_epoch == 96 // 32
    trainer.fit()
    assert trainer.step == 3 and trainer.batch_in_epoch == 0
    with pytest.raises(ValueError, match="accumulate_steps must be at least 1, got 0"):
        Trainer(tiny_config(out, accumulate_steps=0), tmp_path / "zero")


class RecordsScoreDtype(torch.nn.Module):
    """InfoNCE that remembers the dtype of the scores it was given."""

    dtypes: list = []

    def __init__(self) -> None:
        super().__init__()
        self.inner = OBJECTIVES.build({"type": "InfoNCELoss", "temperature": 0.1})

    def forward(self, inputs):
        RecordsScoreDtype.dtypes.append(inputs.scores.dtype)
        return self.inner(inputs)


@pytest.fixture
def dtype_recorder():
    OBJECTIVES.register("RecordsScoreDtype", force=True)(RecordsScoreDtype)
    yield
    OBJECTIVES._entries.pop("RecordsScoreDtype")


def test_a_bf16_autocast_run_on_the_cpu_trains_with_finite_losses(tiny_benchmark, tmp_path,
                                                                   dtype_recorder):
    out, _ = tiny_benchmark
    cfg = tiny_config(out, epochs=1, log_every=1, precision="bf16")
    cfg["objective"] = {"type": "RecordsScoreDtype"}
    cfg["hooks"] = []
    RecordsScoreDtype.dtypes.clear()
    trainer = Trainer(cfg, tmp_path / "bf16")
    initial = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    assert "torch one process on cpu, bf16 autocast" in trainer.strategy.describe()
    report = trainer.fit()
    assert set(RecordsScoreDtype.dtypes) == {torch.bfloat16}  # the products ran in bf16
    steps = [json.loads(line) for line in (tmp_path / "bf16" / "metrics.jsonl").open()
             if '"train"' in line]
    assert len(steps) == 6 and all(math.isfinite(r["loss"]) for r in steps)
    weights = trainer.model.state_dict()
    assert all(p.dtype == torch.float32 for p in weights.values() if p.is_floating_point())
    assert any(not torch.equal(initial[k], weights[k]) for k in weights)  # it trained
    assert math.isfinite(report["test"]["rsum"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_a_gpu_stops_before_anything_is_built(tiny_benchmark, tmp_path, capsys):
    out, _ = tiny_benchmark
    with pytest.raises(ValueError, match="train.device 'cuda' asks for a GPU, but this machine "
                                         "has no CUDA device"):
        Trainer(tiny_config(out, device="cuda"), tmp_path / "run")
    assert not (tmp_path / "run").exists()  # no checkpoint folder, no model built
    config = tmp_path / "cuda.yaml"
    config.write_text(yaml.safe_dump(tiny_config(out, device="cuda:0")))
    assert finetune_tool().main([str(config), "--work-dir", str(tmp_path / "cli")]) == 2
    assert "error: train.device 'cuda:0' asks for a GPU" in capsys.readouterr().err


def test_precision_is_set_under_train_only(tiny_benchmark, tmp_path):
    out, _ = tiny_benchmark
    cfg = tiny_config(out, precision="bf16")
    cfg["strategy"] = {"type": "deepspeed", "precision": "fp32"}
    with pytest.raises(ValueError, match="strategy.precision is now train.precision: move "
                                         "'precision: fp32' under train"):
        Trainer(cfg, tmp_path / "run")


def test_a_loss_scale_overflow_skips_the_step_halves_the_scale_and_is_checkpointed(
        tiny_benchmark, tmp_path):
    """fp16's GradScaler path, on the CPU: the scaler is switched on by hand with a scale
    so large that the scaled gradients overflow (fp16 itself trains on GPUs only)."""
    out, _ = tiny_benchmark
    cfg = tiny_config(out, epochs=1)
    trainer = Trainer(cfg, tmp_path / "run")
    strategy = trainer.strategy
    strategy.scaler = torch.amp.GradScaler("cpu", init_scale=1e38)
    batch = next(iter(trainer._loader()))
    before = {k: v.clone() for k, v in trainer.model.named_parameters()}
    result = strategy.train_step([batch])
    assert not result.applied and result.nonfinite
    assert torch.isfinite(result.outputs["loss"])  # the loss was fine, its scaled gradient not
    assert strategy.scaler.get_scale() == pytest.approx(5e37)
    assert all(torch.equal(before[k], v) for k, v in trainer.model.named_parameters())
    strategy.scaler.update(1024.0)
    result = strategy.train_step([batch])
    assert result.applied and not result.nonfinite
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.named_parameters())
    trainer.save()
    resumed = Trainer(cfg, tmp_path / "run", resume=True)
    resumed.strategy.scaler = torch.amp.GradScaler("cpu")
    resumed.strategy.load(resumed.checkpoint_dir)
    assert resumed.strategy.scaler.get_scale() == 1024.0


def test_set_objective_swaps_what_the_steps_use_and_back(tiny_benchmark, tmp_path):
    out, _ = tiny_benchmark
    trainer = Trainer(tiny_config(out, epochs=1), tmp_path / "run")
    strategy = trainer.strategy
    configured = strategy.module.objective
    assert trainer.objective is strategy.objective is configured
    warmup = OBJECTIVES.build({"type": "TripletLoss", "margin": 0.2, "max_violation": False})
    batch = next(iter(trainer._loader()))
    # the step's loss is the swapped-in objective's: the sum of hinges is at least the
    # hardest-negative hinge of the same scores
    with torch.no_grad():
        hardest = float(strategy.module(strategy.to_device(batch))["loss"])
        trainer.objective = warmup  # what ObjectiveWarmup does
        assert strategy.objective is warmup and trainer.objective is warmup
        summed = float(strategy.module(strategy.to_device(batch), strategy.objective)["loss"])
    assert summed > hardest > 0
    swaps = strategy._objective_swaps
    trainer.objective = warmup  # the same one again: nothing changes, DDP keeps its wrapper
    assert strategy._objective_swaps == swaps
    trainer.objective = configured
    assert strategy.objective is configured and strategy._objective_swaps == swaps + 1
    # the configured objective stays the training module's child: its state is checkpointed
    assert strategy.module.objective is configured


def test_evaluation_weights_load_into_a_plain_model_or_go_to_a_copy(tiny_benchmark, tmp_path):
    out, _ = tiny_benchmark
    trainer = Trainer(tiny_config(out, epochs=1), tmp_path / "run")
    strategy = trainer.strategy
    assert strategy.plain_module
    weights = {k: torch.full_like(v, 0.5) if v.is_floating_point() else v
               for k, v in strategy.full_state_dict().items()}
    assert strategy.evaluation_weights(weights) is None  # loaded: evaluate the model itself
    assert trainer.evaluation_model(weights) is trainer.model
    assert all(torch.equal(v, weights[k]) for k, v in trainer.model.state_dict().items())
    strategy.plain_module = False  # as under ZeRO-3 or a bf16 engine
    trained = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    assert strategy.evaluation_weights(weights) is weights
    copy = trainer.evaluation_model(weights)
    assert copy is not trainer.model
    assert all(torch.equal(v, weights[k]) for k, v in copy.state_dict().items())
    assert all(torch.equal(v, trained[k]) for k, v in trainer.model.state_dict().items())


def test_the_trainer_closes_its_strategy_when_its_block_ends(tiny_benchmark, tmp_path,
                                                            monkeypatch):
    out, _ = tiny_benchmark
    closed = []
    with Trainer(tiny_config(out, epochs=1), tmp_path / "run") as trainer:
        monkeypatch.setattr(trainer.strategy, "close", lambda: closed.append("clean"))
    assert closed == ["clean"]
    # an exception leaves the process group alone: other ranks may be gone or inside a
    # collective that a barrier would wait on
    with pytest.raises(RuntimeError, match="boom"):
        with Trainer(tiny_config(out, epochs=1), tmp_path / "other") as trainer:
            monkeypatch.setattr(trainer.strategy, "close", lambda: closed.append("error"))
            raise RuntimeError("boom")
    assert closed == ["clean"]
