"""The single-process trainer: build everything from a config, train, evaluate, report.

A run directory holds ``config.yaml`` (resolved), ``metrics.jsonl`` (one JSON
object per logged step and epoch), ``checkpoints/last.pt`` (everything needed
to resume exactly: model, optimizer, step, position in the epoch, RNG states),
``checkpoints/best.pt`` (weights of the best epoch by validation rsum) and
``report.json`` (test metrics of the best checkpoint under ``"test"``).
SIGINT/SIGTERM stop the run after the current step with a checkpoint; a
second SIGINT stops it at once.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

import mmgoal
from mmgoal.config import dump_config
from mmgoal.data.pipeline import expand_shards, read_captions
from mmgoal.data.transforms import build_transforms
from mmgoal.engine.checkpoint import load_checkpoint, save_checkpoint
from mmgoal.engine.optimizers import build_optimizer
from mmgoal.engine.schedules import LRSchedule
from mmgoal.evaluation.gallery import SCORING_DEFAULTS, evaluate_retrieval
from mmgoal.objectives.mining import positives_from_groups
from mmgoal.registry import (
    CONSTRAINTS,
    DATASETS,
    HOOKS,
    MODELS,
    OBJECTIVES,
    TOKENIZERS,
    accepted_kwargs,
    import_custom_modules,
    load_plugins,
)

logger = logging.getLogger(__name__)

TOP_LEVEL_KEYS = ("model", "objective", "data", "optimizer", "schedule", "train", "hooks",
                  "custom_imports", "evaluation", "load_from", "constraints")
TRAIN_DEFAULTS: dict[str, Any] = {
    "epochs": 10, "seed": 0, "clip_grad": 2.0, "log_every": 10, "eval_every": 1,
    "checkpoint_every_steps": 0, "max_nonfinite_steps": 5, "progress": True,
    "samples_per_epoch": None,
}
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
    """Appends one JSON object per line to ``metrics.jsonl``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, record: dict) -> None:
        with open(self.path, "a") as stream:
            stream.write(json.dumps(record) + "\n")


class Trainer:
    """Builds model, data, objective and optimizer from ``cfg`` and trains them.

    Args:
        cfg: a resolved config (see ``load_config``).
        work_dir: the run directory.
        resume: continue from ``work_dir/checkpoints/last.pt``.
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
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        import_custom_modules(cfg.get("custom_imports", []))
        load_plugins()
        self.train_cfg = _with_defaults("train", cfg.get("train"), TRAIN_DEFAULTS)
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
        self.resume_state = None
        if resume:
            last = self.checkpoint_dir / "last.pt"
            if not last.is_file():
                raise FileNotFoundError(f"--resume: no checkpoint at {last}; start without "
                                        f"--resume or point --work-dir at the interrupted run")
            self.resume_state = load_checkpoint(last)

        start_from = (load_checkpoint(cfg["load_from"])
                      if cfg.get("load_from") and self.resume_state is None else None)
        torch.manual_seed(self.train_cfg["seed"])
        random.seed(self.train_cfg["seed"])
        self.tokenizer = TOKENIZERS.build(splits["tokenizer"])
        if self.resume_state is not None:
            self.tokenizer.load_state_dict(self.resume_state["tokenizer"])
        elif start_from is not None:
            # A later stage keeps the vocabulary its weights were trained with.
            self.tokenizer.load_state_dict(start_from["tokenizer"])
        elif not self.tokenizer.fitted:
            self.tokenizer.fit(read_captions(splits["train"]["shards"]))
        size = self.data_cfg["image_size"]
        self.train_transform = build_transforms(self.data_cfg["train_transforms"], size)
        self.eval_transform = build_transforms(self.data_cfg["eval_transforms"], size)
        self.model = MODELS.build(cfg["model"], tokenizer=self.tokenizer)
        self.objective = OBJECTIVES.build(cfg["objective"])
        # Hooks may swap the active objective (ObjectiveWarmup); this one is checkpointed.
        self.configured_objective = self.objective
        if not isinstance(self.objective, torch.nn.Module):
            raise TypeError(f"objective {cfg['objective']['type']!r} must be a torch.nn.Module")
        # Attention constraints (CCR/CCS) add their losses to the objective's.
        self.constraints = [CONSTRAINTS.build(c) for c in cfg.get("constraints") or []]
        if self.constraints and not hasattr(self.model, "attention"):
            raise ValueError(f"constraints need a model with cross attention; "
                             f"{cfg['model']['type']} has no attention()")
        if start_from is not None:
            self._load_weights(start_from, cfg["load_from"])
        # Objectives may hold parameters too (InfoNCE's learnable temperature).
        self.optimizer = build_optimizer(cfg["optimizer"], self.model, self.objective)
        self.base_lrs = [group["lr"] for group in self.optimizer.param_groups]
        self.train_set = DATASETS.build(
            splits["train"], tokenizer=self.tokenizer, transform=self.train_transform,
            training=True, seed=self.train_cfg["seed"])
        samples = self.train_cfg["samples_per_epoch"] or self.train_set.num_samples()
        self.steps_per_epoch = max(samples // self.train_set.batch_size, 1)
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
        self.log = MetricLog(self.work_dir / "metrics.jsonl")

        self.epoch = 0
        self.step = 0
        self.batch_in_epoch = 0
        self.best = {"rsum": -math.inf, "epoch": -1}
        self.skipped_samples = 0
        self._stop_signal: int | None = None
        if self.resume_state is not None:
            self._restore(self.resume_state)
        dump_config(cfg, self.work_dir / "config.yaml")

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "objective": self.configured_objective.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "tokenizer": self.tokenizer.state_dict(),
            "epoch": self.epoch,
            "step": self.step,
            "batch_in_epoch": self.batch_in_epoch,
            "best": dict(self.best),
            "skipped_samples": self.skipped_samples,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
            "config": self.cfg,
            "mmgoal_version": mmgoal.__version__,
        }

    def _restore(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.configured_objective.load_state_dict(state["objective"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.epoch, self.step = state["epoch"], state["step"]
        self.batch_in_epoch = state["batch_in_epoch"]
        self.best = dict(state["best"])
        self.skipped_samples = state["skipped_samples"]
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        logger.info("resumed at epoch %d, step %d", self.epoch, self.step)

    def _load_weights(self, state: dict, path: str) -> None:
        """``load_from``: start from another run's model weights (e.g. VSE++ stage one)."""
        try:
            self.model.load_state_dict(state["model"])
        except RuntimeError as error:
            raise ValueError(f"load_from {path}: the checkpoint's model does not match this "
                             f"config's model ({str(error).splitlines()[0]})") from error
        logger.info("model weights loaded from %s", path)

    def save(self, name: str = "last.pt") -> None:
        save_checkpoint(self.state_dict(), self.checkpoint_dir / name)

    # -------------------------------------------------------------- training
    def _set_lr(self) -> float:
        factor = self.schedule.factor(self.step)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * factor
        return self.optimizer.param_groups[0]["lr"]

    def training_step(self, batch: dict) -> dict[str, torch.Tensor]:
        """Forward, objective, backward and optimizer step for one batch."""
        image_features = self.model.encode_image(batch)
        text_features = self.model.encode_text(batch)
        sims = self.model.similarity(image_features, text_features)
        outputs = self.objective(sims, positives=positives_from_groups(batch["image_groups"]),
                                 **accepted_kwargs(self.objective.forward, {
                                     "model": self.model, "image_features": image_features,
                                     "text_features": text_features}))
        if self.constraints:  # image b and text b of a training batch are a matched pair
            attention = self.model.attention(image_features, text_features)
            for constraint in self.constraints:
                outputs.update(constraint(attention))
        loss = sum(v for k, v in outputs.items() if k.endswith("_loss"))
        self.optimizer.zero_grad(set_to_none=True)
        if not torch.isfinite(loss):
            return {"loss": loss.detach(), **outputs, "nonfinite": True}
        loss.backward()
        # The norm of every gradient (clipped to clip_grad when set): a NaN/inf gradient
        # under a finite loss skips the step like a non-finite loss does.
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), self.train_cfg["clip_grad"] or math.inf)
        if not torch.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            return {"loss": loss.detach(), **outputs, "nonfinite": True}
        self.optimizer.step()
        return {"loss": loss.detach(), **outputs, "nonfinite": False}

    def _loader(self) -> torch.utils.data.DataLoader:
        self.train_set.set_epoch(self.epoch)
        workers = self.data_cfg["num_workers"]
        return torch.utils.data.DataLoader(self.train_set, batch_size=None, num_workers=workers,
                                           persistent_workers=False,
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

    def _train_epoch(self) -> bool:
        """One epoch (or its rest, after a resume); False when stopped by a signal."""
        self.model.train()  # before the hooks, which may put frozen parts in eval mode
        for hook in self.hooks:
            hook.before_epoch(self)
        cfg = self.train_cfg
        skip = self.batch_in_epoch
        bar = tqdm(total=self.steps_per_epoch, initial=skip, desc=f"epoch {self.epoch}",
                   unit="step", disable=not cfg["progress"], dynamic_ncols=True)
        nonfinite_run = 0
        tick, samples_since = time.perf_counter(), 0
        for index, batch in enumerate(self._loader()):
            if index < skip:  # resuming inside an epoch: replay the data order, skip the work
                continue
            lr = self._set_lr()
            outputs = self.training_step(batch)
            self.skipped_samples += batch["skipped"]
            if outputs["nonfinite"]:
                nonfinite_run += 1
                logger.warning("non-finite loss or gradient at step %d: step skipped", self.step)
                if nonfinite_run >= cfg["max_nonfinite_steps"]:
                    raise FloatingPointError(
                        f"{nonfinite_run} non-finite losses in a row (step {self.step}; a NaN/inf "
                        f"loss or gradient); lower "
                        f"the learning rate, check the data, or raise train.max_nonfinite_steps")
            else:
                nonfinite_run = 0
            self.step += 1
            self.batch_in_epoch += 1
            samples_since += len(batch["captions"])
            for hook in self.hooks:
                hook.after_step(self, outputs)
            if self.step % cfg["log_every"] == 0:
                elapsed = time.perf_counter() - tick
                record = {"type": "train", "epoch": self.epoch, "step": self.step, "lr": lr,
                          "samples_per_s": samples_since / max(elapsed, 1e-9),
                          "skipped_samples": self.skipped_samples}
                record.update({k: float(v.detach()) for k, v in outputs.items()
                               if isinstance(v, torch.Tensor) and v.numel() == 1})
                self.log.write(record)
                bar.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{lr:.2e}",
                                img_s=f"{record['samples_per_s']:.0f}")
                tick, samples_since = time.perf_counter(), 0
            bar.update(1)
            every = cfg["checkpoint_every_steps"]
            if every and self.step % every == 0:
                self.save()
            if self._stop_signal is not None:
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

    def _end_of_epoch(self) -> dict[str, float]:
        epoch = self.epoch
        metrics: dict[str, float] = {}
        every = self.train_cfg["eval_every"]
        last_epoch = epoch + 1 == self.train_cfg["epochs"]
        if self.splits["val"] and every and ((epoch + 1) % every == 0 or last_epoch):
            metrics = self.evaluate("val")
            self.log.write({"type": "val", "epoch": epoch, "step": self.step, **metrics})
            logger.info("epoch %d val: %s", epoch, format_metrics(metrics))
            if metrics["rsum"] > self.best["rsum"]:
                self.best = {"rsum": metrics["rsum"], "epoch": epoch}
                save_checkpoint({"model": self.model.state_dict(),
                                 "tokenizer": self.tokenizer.state_dict(),
                                 "epoch": epoch, "metrics": metrics, "config": self.cfg},
                                self.checkpoint_dir / "best.pt")
        self.epoch += 1
        self.batch_in_epoch = 0
        self.save()
        return metrics

    def evaluate(self, split: str) -> dict[str, float]:
        """Retrieval metrics of the current model on ``split`` (``val`` or ``test``)."""
        split_cfg = self.splits[split]
        if not split_cfg:
            raise ValueError(f"the config has no 'data.{split}' section to evaluate on")
        return evaluate_retrieval(
            self.model, split_cfg["shards"], self.eval_transform, self.tokenizer,
            batch_size=self.data_cfg["eval_batch_size"], folds=split_cfg.get("folds", 1),
            progress=self.train_cfg["progress"], scoring=self.eval_cfg)

    def _final_report(self, seconds: float) -> dict:
        report: dict[str, Any] = {"epochs": self.epoch, "steps": self.step,
                                  "train_seconds": seconds, "best": self.best,
                                  "skipped_samples": self.skipped_samples}
        best_path = self.checkpoint_dir / "best.pt"
        if best_path.is_file():
            self.model.load_state_dict(load_checkpoint(best_path)["model"])
        if self.splits["test"]:
            report["test"] = self.evaluate("test")
            self.log.write({"type": "test", "step": self.step, **report["test"]})
        (self.work_dir / "report.json").write_text(json.dumps(report, indent=2))
        return report


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


def check_data_paths(cfg: dict) -> None:
    """Fail early, with the command to run, when a split's shards are missing."""
    for split in ("train", "val", "test"):
        section = cfg.get("data", {}).get(split)
        if section:
            expand_shards(section["shards"])
