"""The trainer: build everything from a config, train, evaluate, report.

The trainer is the same for one process, ``torchrun`` and ``deepspeed``, on
CPUs and GPUs: the strategy (``strategy:`` in the config, ``--deepspeed`` on the
command line; ``torch`` by default: one process, or torch DDP under a launcher)
owns the device (``train.device``), processes, optimizer, precision
(``train.precision``) and checkpoint files. A run directory holds
``config.yaml`` (resolved), ``metrics.jsonl`` (one JSON object per logged step
and epoch), ``checkpoints/`` (the strategy's resumable checkpoint: model,
optimizer, step, position in the epoch, every rank's RNG state; and
``best.pt``, the float32 weights of the best epoch by validation rsum) and
``report.json`` (test metrics of the best checkpoint under ``"test"``). Rank 0
alone writes them and shows progress bars.

An optimisation step takes ``train.accumulate_steps`` micro-batches of
``data.train.batch_size`` on every rank (one window, handed to the strategy's
``train_step``): the global batch is their product with the number of
processes, and an epoch is ``train.samples_per_epoch`` (default: the training
split's size) divided by it. SIGINT/SIGTERM on any rank stop every
rank after the same step, with a checkpoint; a second SIGINT stops at once.
"""

from __future__ import annotations

import inspect
import itertools
import json
import logging
import math
import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

import mmgoal
from mmgoal.config import dump_config
from mmgoal.data.pipeline import expand_shards, read_captions
from mmgoal.data.transforms import build_transforms
from mmgoal.devices import configure_cuda, resolve_device
from mmgoal.engine.checkpoint import (
    load_checkpoint,
    load_matching_weights,
    save_checkpoint,
    summarise_keys,
)
from mmgoal.engine.schedules import LRSchedule
from mmgoal.engine.step import TrainingStep
from mmgoal.evaluation.gallery import SCORING_DEFAULTS, evaluate_retrieval
from mmgoal.models.efficiency import compile_model
from mmgoal.registry import (
    CONSTRAINTS,
    DATASETS,
    HOOKS,
    MODELS,
    OBJECTIVES,
    STRATEGIES,
    TOKENIZERS,
    import_custom_modules,
    load_plugins,
)

logger = logging.getLogger(__name__)

TOP_LEVEL_KEYS = ("model", "objective", "data", "optimizer", "schedule", "train", "hooks",
                  "custom_imports", "evaluation", "load_from", "constraints", "strategy")
TRAIN_DEFAULTS: dict[str, Any] = {
    "epochs": 10, "seed": 0, "clip_grad": 2.0, "log_every": 10, "eval_every": 1,
    "checkpoint_every_steps": 0, "max_nonfinite_steps": 5, "progress": True,
    "samples_per_epoch": None, "accumulate_steps": 1, "gather_features": True,
    "scale_lr": "none", "reference_batch": None,
    # where and how (docs/getting_started.md, "Training on GPUs")
    "device": "auto", "precision": "fp32", "matmul_precision": "high", "cudnn_benchmark": True,
    "sync_bn": False, "compile": False,
}
LR_SCALINGS = ("none", "linear", "sqrt")
DATA_DEFAULTS: dict[str, Any] = {
    "image_size": 64, "num_workers": 1, "train_transforms": None, "eval_transforms": None,
    "eval_batch_size": 256,
}
EVALUATION_DEFAULTS: dict[str, Any] = dict(SCORING_DEFAULTS)


def _with_defaults(section: str, given: dict | None, defaults: dict) -> dict:
    given = dict(given or {})
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(unknown)} in '{section}'; known keys: "
                         f"{', '.join(sorted(defaults))}")
    return {**defaults, **given}


def _ignore_stop_signals(worker_id: int) -> None:
    """Data workers leave SIGINT/SIGTERM to the main process, which stops cleanly."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class MetricLog:
    """Appends one JSON object per line to ``metrics.jsonl`` (rank 0 only: ``enabled``)."""

    def __init__(self, path: Path, enabled: bool = True) -> None:
        self.path = path
        self.enabled = enabled

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as stream:
            stream.write(json.dumps(record) + "\n")


class Trainer:
    """Builds model, data, objective and strategy from ``cfg`` and trains them.

    Args:
        cfg: a resolved config (see ``load_config``).
        work_dir: the run directory.
        resume: continue from the latest checkpoint in ``work_dir/checkpoints``.
    """

    def __init__(self, cfg: dict, work_dir: str | Path, resume: bool = False) -> None:
        unknown = sorted(set(cfg) - set(TOP_LEVEL_KEYS))
        if unknown:
            raise ValueError(f"unknown top-level config key(s) {', '.join(unknown)}; known: "
                             f"{', '.join(TOP_LEVEL_KEYS)}")
        for key in ("model", "objective", "data", "optimizer"):
            if key not in cfg:
                raise ValueError(f"the config has no '{key}' section")
        self.cfg = cfg
        self.work_dir = Path(work_dir)
        self.checkpoint_dir = self.work_dir / "checkpoints"
        import_custom_modules(cfg.get("custom_imports", []))
        load_plugins()
        self.train_cfg = _with_defaults("train", cfg.get("train"), TRAIN_DEFAULTS)
        if self.train_cfg["scale_lr"] not in LR_SCALINGS:
            raise ValueError(f"train.scale_lr must be one of {', '.join(LR_SCALINGS)}, got "
                             f"{self.train_cfg['scale_lr']!r}")
        if int(self.train_cfg["accumulate_steps"]) < 1:
            raise ValueError("train.accumulate_steps must be 1 or more")
        data_cfg = dict(cfg["data"])
        splits = {k: data_cfg.pop(k, None) for k in ("tokenizer", "train", "val", "test")}
        for split in ("tokenizer", "train"):
            if splits[split] is None:
                raise ValueError(f"the config has no 'data.{split}' section")
        for split in ("val", "test"):
            unknown = sorted(set(splits[split] or {}) - {"shards", "folds"})
            if unknown:
                raise ValueError(f"unknown key(s) {', '.join(unknown)} in 'data.{split}'; "
                                 f"known keys: folds, shards")
        self.data_cfg = _with_defaults("data", data_cfg, DATA_DEFAULTS)
        self.eval_cfg = _with_defaults("evaluation", cfg.get("evaluation"), EVALUATION_DEFAULTS)
        self.splits = splits
        # The device first: a GPU asked for where there is none stops before anything is built.
        device = resolve_device(self.train_cfg["device"])
        configure_cuda(device, self.train_cfg["matmul_precision"],
                       self.train_cfg["cudnn_benchmark"])
        self.strategy = STRATEGIES.build(
            self._strategy_config(cfg), device=device, precision=self.train_cfg["precision"],
            sync_bn=self.train_cfg["sync_bn"])
        self.is_main = self.strategy.is_main
        if self.is_main:
            self.checkpoint_dir.mkdir(parents=True, exist_ok=True)

        resumed = self.strategy.read_state(self.checkpoint_dir) if resume else None
        start_from = load_checkpoint(cfg["load_from"]) if cfg.get("load_from") and not resume \
            else None
        seed = self.train_cfg["seed"]
        torch.manual_seed(seed)  # the same initial weights on every rank
        random.seed(seed)
        self.tokenizer = TOKENIZERS.build(splits["tokenizer"])
        if resumed is not None or start_from is not None:
            # A resumed run, or a later stage, keeps the vocabulary its weights were trained with.
            self.tokenizer.load_state_dict((resumed or start_from)["tokenizer"])
        elif not self.tokenizer.fitted:
            # Fitted from the data alone, so every rank (and a resumed run) gets the same.
            self.tokenizer.fit(c for source in training_sources(splits["train"])
                               for c in read_captions(source["shards"],
                                                      source.get("caption_key")))
        size = self.data_cfg["image_size"]
        self.train_transform = build_transforms(self.data_cfg["train_transforms"], size)
        self.eval_transform = build_transforms(self.data_cfg["eval_transforms"], size)
        self.model = MODELS.build(cfg["model"], tokenizer=self.tokenizer)
        self.objective = OBJECTIVES.build(cfg["objective"], tokenizer=self.tokenizer)
        # Hooks may swap the active objective (ObjectiveWarmup); this one is checkpointed.
        self.configured_objective = self.objective
        if not isinstance(self.objective, torch.nn.Module):
            raise TypeError(f"objective {cfg['objective']['type']!r} must be a torch.nn.Module")
        # Attention constraints (CCR/CCS) add their losses to the objective's.
        constraints = [CONSTRAINTS.build(c) for c in cfg.get("constraints") or []]
        if constraints and not hasattr(self.model, "attention"):
            raise ValueError(f"constraints need a model with cross attention; "
                             f"{cfg['model']['type']} has no attention()")
        if start_from is not None:
            self._load_weights(start_from, cfg["load_from"])

        self.train_set = DATASETS.build(
            splits["train"], tokenizer=self.tokenizer, transform=self.train_transform,
            training=True, seed=seed)
        if hasattr(self.train_set, "check_readers"):
            self.train_set.check_readers(self.strategy.world_size,
                                         max(self.data_cfg["num_workers"], 1))
        self.accumulate_steps = int(self.train_cfg["accumulate_steps"])
        micro_batch = self.train_set.batch_size
        self.global_batch = micro_batch * self.accumulate_steps * self.strategy.world_size
        samples = self.train_cfg["samples_per_epoch"] or self.train_set.num_samples()
        self.steps_per_epoch = max(samples // self.global_batch, 1)
        optimizer_cfg = self._scaled_optimizer_config(cfg["optimizer"])
        if self.train_cfg["compile"]:
            compiled = compile_model(self.model)
            logger.info("torch.compile: %s (compiled at their first call)", ", ".join(compiled))
        self.step_module = TrainingStep(self.model, self.objective, constraints,
                                        gather=self.train_cfg["gather_features"])
        self.strategy.setup(self.step_module, optimizer_cfg, micro_batch, self.accumulate_steps,
                            self.train_cfg["clip_grad"])
        self.model = self.strategy.model
        if self.strategy.rank:  # different dropout masks and augmentations on every rank
            torch.manual_seed(seed + 1000 * self.strategy.rank)
        self.base_lrs = [group["lr"] for group in self.strategy.param_groups()]
        schedule_cfg = dict(cfg.get("schedule") or {"type": "constant"})
        set_by_trainer = ("kind", "total_steps", "steps_per_epoch")
        known = ("type", *(p for p in inspect.signature(LRSchedule).parameters
                           if p not in set_by_trainer))
        unknown = sorted(set(schedule_cfg) - set(known))
        if unknown:
            raise ValueError(f"unknown key(s) {', '.join(unknown)} in 'schedule'; known keys: "
                             f"{', '.join(known)}")
        self.schedule = LRSchedule(kind=schedule_cfg.pop("type", "cosine"),
                                   total_steps=self.steps_per_epoch * self.train_cfg["epochs"],
                                   steps_per_epoch=self.steps_per_epoch, **schedule_cfg)
        self.hooks = [HOOKS.build(h) for h in cfg.get("hooks") or []]
        self.log = MetricLog(self.work_dir / "metrics.jsonl", enabled=self.is_main)

        self.epoch = 0
        self.step = 0
        self.batch_in_epoch = 0
        self.best = {"rsum": -math.inf, "epoch": -1}
        self.skipped_samples = 0
        self._samples_since_log = 0  # samples (all ranks) since the last logged step
        self.source_counts: dict[str, int] = {}  # samples per source of a mixture, this rank
        self._stop_signal: int | None = None
        if resume:
            self._restore(self.strategy.load(self.checkpoint_dir, resumed))
        if self.is_main:
            dump_config(cfg, self.work_dir / "config.yaml")
        lr = ("from the DeepSpeed scheduler" if self.strategy.owns_schedule else
              f"{self.base_lrs[0]:.3g} (scale_lr {self.train_cfg['scale_lr']})")
        logger.info("%s; global batch %d = %d per rank x %d rank(s) x %d accumulation step(s); "
                    "%d steps per epoch (%d samples); base lr %s", self.strategy.describe(),
                    self.global_batch, micro_batch, self.strategy.world_size,
                    self.accumulate_steps, self.steps_per_epoch, samples, lr)

    def _strategy_config(self, cfg: dict) -> dict:
        """The ``strategy`` section (default ``torch``), its precision agreeing with train's."""
        strategy = dict(cfg.get("strategy") or {"type": "torch"})
        own = strategy.get("precision")
        given = (cfg.get("train") or {}).get("precision")
        if own is not None and given is not None and own != given:
            raise ValueError(f"train.precision is {given!r} but strategy.precision is {own!r}; "
                             f"set train.precision alone")
        return strategy

    @property
    def optimizer(self):
        """The strategy's optimizer (its ``param_groups`` carry the learning rates)."""
        return self.strategy.optimizer

    def _scaled_optimizer_config(self, optimizer_cfg: dict) -> dict:
        """``train.scale_lr``: the configured lr is for ``train.reference_batch`` samples."""
        rule = self.train_cfg["scale_lr"]
        if rule == "none":
            return optimizer_cfg
        reference = self.train_cfg["reference_batch"] or self.train_set.batch_size
        ratio = self.global_batch / reference
        factor = ratio if rule == "linear" else math.sqrt(ratio)
        lr = optimizer_cfg.get("lr")
        if lr is None:
            raise ValueError("train.scale_lr needs optimizer.lr set in the config")
        return {**optimizer_cfg, "lr": lr * factor}

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict:
        """The trainer's own state (the strategy adds model, optimizer and RNG states)."""
        return {
            "tokenizer": self.tokenizer.state_dict(),
            "epoch": self.epoch,
            "step": self.step,
            "batch_in_epoch": self.batch_in_epoch,
            "best": dict(self.best),
            "skipped_samples": self.skipped_samples,
            "config": self.cfg,
            "mmgoal_version": mmgoal.__version__,
        }

    def _restore(self, state: dict) -> None:
        self.epoch, self.step = state["epoch"], state["step"]
        self.batch_in_epoch = state["batch_in_epoch"]
        self.best = dict(state["best"])
        self.skipped_samples = state["skipped_samples"]
        logger.info("resumed at epoch %d, step %d", self.epoch, self.step)

    def _load_weights(self, state: dict, path: str) -> None:
        """``load_from``: start from another run's model weights (a pretraining checkpoint,
        VSE++ stage one); heads either side lacks are listed, a different model refused."""
        saved = ((state.get("config") or {}).get("model") or {}).get("type")
        wanted = self.cfg["model"]["type"]
        if saved is not None and saved != wanted:
            raise ValueError(f"load_from {path}: a {saved} checkpoint cannot start a {wanted} "
                             f"model; give a checkpoint of a {wanted} run")
        self.handoff = load_matching_weights(self.model, state["model"], f"load_from {path}")
        logger.info("model weights loaded from %s", path)
        if self.handoff["dropped"]:
            logger.warning("load_from: dropped %d checkpoint tensors this model has no place "
                           "for: %s", len(self.handoff["dropped"]),
                           summarise_keys(self.handoff["dropped"]))
        if self.handoff["missing"]:
            logger.warning("load_from: %d tensors of this model are not in the checkpoint and "
                           "keep their initial values: %s", len(self.handoff["missing"]),
                           summarise_keys(self.handoff["missing"]))

    def save(self) -> None:
        """A resumable checkpoint (collective: every rank calls it)."""
        self.strategy.save(self.checkpoint_dir, self.state_dict())

    def save_weights(self, name: str, **extra: Any) -> None:
        """The float32 weights (+ tokenizer, config) as ``checkpoints/<name>`` (collective)."""
        self._write_weights(name, self.strategy.full_state_dict(), **extra)

    def _write_weights(self, name: str, weights: dict | None, **extra: Any) -> None:
        """Rank 0 writes ``weights`` (its ``full_state_dict()``); every rank waits."""
        if self.is_main:
            save_checkpoint({"model": weights, "tokenizer": self.tokenizer.state_dict(),
                             "config": self.cfg, **extra}, self.checkpoint_dir / name)
        self.strategy.barrier()

    # -------------------------------------------------------------- training
    def _set_lr(self) -> float:
        groups = self.strategy.param_groups()
        if not self.strategy.owns_schedule:
            factor = self.schedule.factor(self.step)
            for group, base in zip(groups, self.base_lrs):
                group["lr"] = base * factor
        return groups[0]["lr"]

    def _loader(self) -> torch.utils.data.DataLoader:
        self.train_set.set_epoch(self.epoch)
        workers = self.data_cfg["num_workers"]
        return torch.utils.data.DataLoader(self.train_set, batch_size=None, num_workers=workers,
                                           persistent_workers=False,
                                           pin_memory=self.strategy.device.type == "cuda",
                                           worker_init_fn=_ignore_stop_signals)

    def _handle_signal(self, signum: int, frame: Any) -> None:
        if self._stop_signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self._stop_signal = signum
        logger.warning("received %s: stopping after this step with a checkpoint",
                       signal.Signals(signum).name)

    def fit(self) -> dict:
        """Train for the configured epochs, then evaluate the best checkpoint on the test split.

        Returns:
            The report (also written to ``report.json``).
        """
        # Signal handlers can only be installed from the main thread.
        in_main = threading.current_thread() is threading.main_thread()
        previous = {sig: signal.signal(sig, self._handle_signal)
                    for sig in (signal.SIGINT, signal.SIGTERM)} if in_main else {}
        start = time.perf_counter()
        try:
            for hook in self.hooks:
                hook.before_train(self)
            while self.epoch < self.train_cfg["epochs"]:
                if not self._train_epoch():
                    return {"interrupted": True, "epoch": self.epoch, "step": self.step}
            for hook in self.hooks:
                hook.after_train(self)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return self._final_report(time.perf_counter() - start)

    def _window(self, batches: Iterator[dict]) -> Iterator[dict]:
        """The next ``accumulate_steps`` micro-batches, counted as the strategy takes them."""
        for batch in itertools.islice(batches, self.accumulate_steps):
            self.skipped_samples += batch["skipped"]
            for name, count in batch.get("source_counts", {}).items():
                self.source_counts[name] = self.source_counts.get(name, 0) + count
            self.batch_in_epoch += 1
            self._samples_since_log += len(batch["captions"]) * self.strategy.world_size
            yield batch

    def _train_epoch(self) -> bool:
        """One epoch (or its rest, after a resume); False when stopped by a signal."""
        self.model.train()  # before the hooks, which may put frozen parts in eval mode
        for hook in self.hooks:
            hook.before_epoch(self)
        cfg = self.train_cfg
        micro_batches = self.steps_per_epoch * self.accumulate_steps
        bar = tqdm(total=self.steps_per_epoch, initial=self.step % self.steps_per_epoch,
                   desc=f"epoch {self.epoch}", unit="step", dynamic_ncols=True,
                   disable=not (cfg["progress"] and self.is_main))
        batches = iter(self._loader())
        # Resuming inside an epoch: replay the data order, skip the work.
        for _ in itertools.islice(batches, self.batch_in_epoch):
            pass
        nonfinite_run = 0
        tick, self._samples_since_log = time.perf_counter(), 0
        while self.batch_in_epoch < micro_batches:
            lr = self._set_lr()
            result = self.strategy.train_step(self._window(batches), self.objective)
            if not result.micro_batches:  # the data ran out before the epoch's steps
                break
            outputs = {**result.outputs, "nonfinite": result.nonfinite}
            if result.nonfinite:
                nonfinite_run += 1
                logger.warning("non-finite loss or gradient at step %d: step skipped", self.step)
                if nonfinite_run >= cfg["max_nonfinite_steps"]:
                    raise FloatingPointError(
                        f"{nonfinite_run} non-finite losses in a row (step {self.step}; a NaN/inf "
                        f"loss or gradient); lower the learning rate, check the data, or raise "
                        f"train.max_nonfinite_steps")
            else:
                nonfinite_run = 0
            self.step += 1
            for hook in self.hooks:
                hook.after_step(self, outputs)
            if self.step % cfg["log_every"] == 0:
                elapsed = time.perf_counter() - tick
                record = {"type": "train", "epoch": self.epoch, "step": self.step, "lr": lr,
                          "samples_per_s": self._samples_since_log / max(elapsed, 1e-9),
                          "skipped_samples": self.skipped_samples,
                          **{f"samples_{name}": n for name, n in self.source_counts.items()}}
                record.update({k: float(v) for k, v in result.outputs.items()})
                if self.strategy.device.type == "cuda":
                    record["max_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
                self.log.write(record)
                bar.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{lr:.2e}",
                                img_s=f"{record['samples_per_s']:.0f}")
                tick, self._samples_since_log = time.perf_counter(), 0
            bar.update(1)
            every = cfg["checkpoint_every_steps"]
            if every and self.step % every == 0:
                self.save()
            # One agreement per step: a signal on any rank stops every rank after this step.
            if self.strategy.agree(self._stop_signal is not None)[0]:
                bar.close()
                self.save()
                logger.warning("stopped at epoch %d, step %d; continue with --resume",
                               self.epoch, self.step)
                return False
        bar.close()
        metrics = self._end_of_epoch()
        for hook in self.hooks:
            hook.after_epoch(self, metrics)
        return True

    def evaluation_model(self, weights: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
        """A float32 model to evaluate on rank 0: the trained one when its weights are full
        float32 ones (loaded with ``weights`` when given), else a copy built with ``weights``."""
        if self.strategy.plain_module:
            if weights is not None:
                self.model.load_state_dict(weights)
            return self.model
        model = MODELS.build(self.cfg["model"], tokenizer=self.tokenizer)
        model.load_state_dict(weights)
        return model.to(self.strategy.device)

    def _end_of_epoch(self) -> dict[str, float]:
        epoch = self.epoch
        metrics: dict[str, float] = {}
        every = self.train_cfg["eval_every"]
        last_epoch = epoch + 1 == self.train_cfg["epochs"]
        if self.splits["val"] and every and ((epoch + 1) % every == 0 or last_epoch):
            # One gather (collective) serves the evaluation copy and best.pt.
            weights = self.strategy.full_state_dict()
            if self.is_main:
                model = self.evaluation_model(None if self.strategy.plain_module else weights)
                metrics = self.evaluate("val", model)
                self.log.write({"type": "val", "epoch": epoch, "step": self.step, **metrics})
                logger.info("epoch %d val: %s", epoch, format_metrics(metrics))
            metrics = self.strategy.broadcast(metrics)
            if metrics["rsum"] > self.best["rsum"]:
                self.best = {"rsum": metrics["rsum"], "epoch": epoch}
                self._write_weights("best.pt", weights, epoch=epoch, metrics=metrics)
        self.epoch += 1
        self.batch_in_epoch = 0
        self.save()
        return metrics

    def evaluate(self, split: str, model: torch.nn.Module | None = None) -> dict[str, float]:
        """Retrieval metrics of ``model`` (default: the trained one) on ``val`` or ``test``."""
        split_cfg = self.splits[split]
        if not split_cfg:
            raise ValueError(f"the config has no 'data.{split}' section to evaluate on")
        return evaluate_retrieval(
            model if model is not None else self.model, split_cfg["shards"],
            self.eval_transform, self.tokenizer, batch_size=self.data_cfg["eval_batch_size"],
            folds=split_cfg.get("folds", 1), progress=self.train_cfg["progress"],
            scoring=self.eval_cfg)

    def _final_report(self, seconds: float) -> dict:
        report: dict[str, Any] = {"epochs": self.epoch, "steps": self.step,
                                  "train_seconds": seconds, "best": self.best,
                                  "skipped_samples": self.skipped_samples}
        if self.splits["test"]:
            if self.best["epoch"] >= 0:  # best.pt exists, and every rank knows it
                weights = (load_checkpoint(self.checkpoint_dir / "best.pt")["model"]
                           if self.is_main else None)
            elif self.strategy.plain_module:  # no validation: the trained model as it is
                weights = None
            else:
                weights = self.strategy.full_state_dict()  # collective
            if self.is_main:
                report["test"] = self.evaluate("test", self.evaluation_model(weights))
                self.log.write({"type": "test", "step": self.step, **report["test"]})
        if self.is_main:
            (self.work_dir / "report.json").write_text(json.dumps(report, indent=2))
        return self.strategy.broadcast(report)


def format_metrics(metrics: dict[str, float]) -> str:
    """One line: R@1/5/10 both ways and rsum."""
    return " ".join(f"{k}={metrics[k]:.1f}" for k in
                    ("i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10", "rsum")
                    if k in metrics)


def metrics_table(metrics: dict[str, float]) -> str:
    """A small text table of retrieval metrics."""
    rows = [f"{'':>6} {'R@1':>7} {'R@5':>7} {'R@10':>7} {'medr':>6} {'meanr':>7}"]
    for direction, name in (("i2t", "i2t"), ("t2i", "t2i")):
        rows.append(f"{name:>6} " + " ".join(
            f"{metrics[f'{direction}_r{k}']:>7.2f}" for k in (1, 5, 10))
            + f" {metrics[f'{direction}_medr']:>6.0f} {metrics[f'{direction}_meanr']:>7.2f}")
    rows.append(f"  rsum {metrics['rsum']:.2f}")
    return "\n".join(rows)


def training_sources(train_cfg: dict) -> list[dict]:
    """The shard sections of a training split: itself, or a mixture's sources."""
    return list(train_cfg.get("sources") or [train_cfg])


def check_data_paths(cfg: dict) -> None:
    """Fail early, with the command to run, when a split's shards are missing."""
    for split in ("train", "val", "test"):
        section = cfg.get("data", {}).get(split)
        for source in training_sources(section) if section else []:
            expand_shards(source["shards"])
