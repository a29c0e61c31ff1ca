"""The trainer: build everything from a config, train, evaluate, report.

The same for one process, ``torchrun`` and ``deepspeed``, on CPUs and GPUs: the strategy
owns the device, processes, optimizer, precision and checkpoint files
(docs/distributed.md). What a run writes: docs/configs.md, "What a run writes"; the
global batch and the epoch: docs/distributed.md, "Batch, learning rate, epoch"; stopping
and resuming: docs/distributed.md, "Interruption and bad steps".
"""

from __future__ import annotations

import functools
import json
import logging
import math
import random
import signal
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import mmgoal
from mmgoal import strict_json
from mmgoal.config import config_text
from mmgoal.console import bars_drawn, progress_bar
from mmgoal.contract import CrossAttentionModel, TowerLockingModel, require
from mmgoal.data.classification import read_classification_set
from mmgoal.data.pipeline import (
    IncompleteSplitError,
    expand_shards,
    read_captions,
    split_overlaps,
)
from mmgoal.data.remote import shard_listing
from mmgoal.data.transforms import build_transforms
from mmgoal.devices import configure_cuda, resolve_device
from mmgoal.distributed import rng_state, set_rng_state
from mmgoal.engine.metric_log import MetricLog
from mmgoal.engine.optimizers import parameter_counts
from mmgoal.engine.signals import (
    StopSignals,
    StopWhileWaitingForData,
    WorkerRelease,
    start_data_worker,
)
from mmgoal.engine.step import TrainingStep
from mmgoal.engine.strategies.base import Strategy
from mmgoal.evaluation.gallery import EvaluationStopped
from mmgoal.evaluation.request import check_best_metric, config_request, evaluate
from mmgoal.evaluation.retrieval import format_metrics, metrics_table
from mmgoal.files import read_text, write_text
from mmgoal.models.efficiency import compile_model
from mmgoal.registry import (
    CONSTRAINTS,
    DATASETS,
    HOOKS,
    LOGGERS,
    MODELS,
    OBJECTIVES,
    SCHEDULES,
    STRATEGIES,
    TOKENIZERS,
    import_custom_modules,
    load_plugins,
)
from mmgoal.runs.checkpoint import (
    describe_tensors,
    load_checkpoint,
    load_matching_weights,
    peek_checkpoint,
    save_checkpoint,
    summarise_keys,
)
from mmgoal.runs.preprocessing import resolve_preprocessing
from mmgoal.runs.run_dir import BEST, CHECKPOINTS, CONFIG_FILE
from mmgoal.runs.schema import RunConfig
from mmgoal.structures import Member

logger = logging.getLogger(__name__)


class Trainer:
    """Builds model, data, objective and strategy from ``cfg`` and trains them in
    ``work_dir`` (``resume``: from its latest checkpoint). Each ``_build_*`` step returns
    what it builds; ``__init__`` alone keeps it.

    A context manager: a clean exit closes the strategy (the process group); an exception
    leaves the group as it is, since other ranks may be gone or inside a collective.
    """

    def __init__(self, cfg: RunConfig | dict, work_dir: str | Path, resume: bool = False
                 ) -> None:
        # checked, every default written out (the CLI's is already: not parsed again)
        self.config = cfg if isinstance(cfg, RunConfig) else RunConfig.from_dict(cfg, "")
        check_best_metric(self.config.train.best_metric, bool(self.config.evaluation.zeroshot))
        self.work_dir = Path(work_dir)
        self.checkpoint_dir = self.work_dir / CHECKPOINTS
        import_custom_modules(self.config.custom_imports)
        load_plugins()
        # Built on every rank, which only checks their options and packages: a bad option
        # stops every rank alike, before anything else is built. Rank 0 alone uses them.
        loggers = [LOGGERS.build(c) for c in self.config.loggers]
        self.strategy = self._build_strategy()
        self.is_main = self.strategy.is_main
        self.log = MetricLog(self.work_dir / "metrics.jsonl", enabled=self.is_main,
                             loggers=loggers, progress=bars_drawn(self.config.train.progress))
        if self.is_main:
            self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        self.log.open_text()  # the setup's lines too; closed by fit, or when collected
        weakref.finalize(self, self.log.close_text)
        resumed = self.strategy.read_state(self.checkpoint_dir) if resume else None
        start_from = (load_checkpoint(self.config.load_from)
                      if self.config.load_from and not resume else None)

        self._seed(rank=0)  # the same initial weights on every rank
        # the config's tokenizer and transforms, else the model's own
        self.preprocessing = resolve_preprocessing(self.config)
        self.tokenizer = self._build_tokenizer(resumed or start_from)
        model, objective, constraints = self._build_model_and_objective()
        self._lock_towers(model)
        # what trains (a LoRA model's adapters: model.peft), counted before a strategy shards
        # it and again as each epoch's hooks (FreezeSchedule) leave it
        self._counted = (model, objective, *constraints)
        self.parameter_counts = parameter_counts(*self._counted)
        self._said_counts: dict[str, int] | None = None
        # load_from: what the checkpoint and the model did not share (None without it)
        self.handoff = (self._load_weights(model, start_from, self.config.load_from)
                        if start_from is not None else None)
        data = self.config.data
        self.train_transform = build_transforms(self.preprocessing.train_transforms,
                                                data.image_size)
        self.eval_transform = build_transforms(self.preprocessing.eval_transforms,
                                               data.image_size)
        self.train_set = self._build_train_set()
        if self.is_main:
            self._warn_split_overlaps()
        # One step takes accumulate_steps micro-batches on every rank.
        self.accumulate_steps = int(self.config.train.accumulate_steps)
        self.global_batch = (self.train_set.batch_size * self.accumulate_steps
                             * self.strategy.world_size)
        self.samples_per_epoch = (self.config.train.samples_per_epoch
                                  or self.train_set.num_samples())
        self.steps_per_epoch = max(self.samples_per_epoch // self.global_batch, 1)
        self.strategy.setup(self._build_step(model, objective, constraints),
                            self._scaled_optimizer_config(), self.train_set.batch_size,
                            self.accumulate_steps, self.config.train.clip_grad)
        self.model = self.strategy.model  # the strategy's (SyncBatchNorm converts the model)
        if self.strategy.rank:
            self._seed(self.strategy.rank)  # from here on, per rank: dropout, augmentations
        self.base_lrs = [group["lr"] for group in self.strategy.param_groups()]
        # The lr logged: the fastest group's, not group 0's (a tower's embeddings under
        # optimizer.layer_decay, or a backbone slowed by paramwise).
        self.lr_group = max(range(len(self.base_lrs)), key=self.base_lrs.__getitem__)
        self.schedule = SCHEDULES.build(self.config.schedule,
                                        total_steps=self.steps_per_epoch * self.config.train.epochs,
                                        steps_per_epoch=self.steps_per_epoch)
        self.hooks = [HOOKS.build(h) for h in self.config.hooks]

        self.epoch = 0
        self.step = 0
        self.batch_in_epoch = 0
        # the epoch's steps are done, its end (validation ... checkpoint) is not: --resume
        # goes on to that end without reading the epoch's data again
        self.epoch_steps_done = False
        # a validation every eval_every_steps is under way: a checkpoint written as a signal
        # or an unreadable split ends it makes --resume validate first
        self.validation_due = False
        # best_metric's best value, the epoch (and step) of its validation; the validations
        # since (early stopping)
        self.best = {self.config.train.best_metric: -math.inf, "epoch": -1}
        self.validations_since_best = 0
        self.stopped_early = False
        self.skipped_samples = 0
        self._samples_since_log = 0  # samples (all ranks) since the last logged step
        self.source_counts: dict[str, int] = {}  # samples per source of a mixture, this rank
        self.signals = StopSignals(alone=self.strategy.world_size == 1)
        # Set when training ends, however: data workers ignore the SIGTERM that would end
        # them, and one left alive (by an exception's traceback) blocks the exit.
        self._release_workers = WorkerRelease()
        self.seconds_before = 0.0  # training time of earlier segments of a resumed run
        self._segment_start = time.perf_counter()
        if resume:
            self._restore(self.strategy.load(self.checkpoint_dir, resumed))
            self._check_resumed_state()
        for sink in self.log.loggers:  # before the run writes its config: nothing half-started
            sink.check(self.work_dir)
        config_file = self.work_dir / CONFIG_FILE
        if self.is_main and not (resume and config_file.is_file()):  # a resumed run keeps its own
            write_text(config_file, config_text(self.config.to_dict()))
        self._log_setup()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, error_type: type | None, *_: Any) -> None:
        if error_type is None:
            self.strategy.close()

    @property
    def objective(self) -> torch.nn.Module:
        """The objective the training steps use: the configured one, or the one a hook
        swapped in (``ObjectiveWarmup`` sets this; :meth:`Strategy.set_objective`)."""
        return self.strategy.objective

    @objective.setter
    def objective(self, objective: torch.nn.Module) -> None:
        self.strategy.set_objective(objective)

    # ---------------------------------------------------------- construction
    def _build_strategy(self) -> Strategy:
        """The strategy on ``train.device``: a GPU asked for where there is none, or
        ``train.keep_epochs`` of a strategy without epoch checkpoints, stops here, before
        anything is built."""
        train = self.config.train
        kind = STRATEGIES.get(self.config.strategy["type"])
        if train.keep_epochs and not kind.supports_epoch_checkpoints:
            raise ValueError(f"train.keep_epochs: {train.keep_epochs} keeps epoch checkpoints "
                             f"of the torch and accelerate strategies (copies of last.pt); "
                             f"{kind.__name__} keeps its newest checkpoint only: remove "
                             f"keep_epochs, or train with the torch strategy")
        device = resolve_device(train.device)
        configure_cuda(device, train.matmul_precision, train.cudnn_benchmark)
        return STRATEGIES.build(self.config.strategy, device=device, precision=train.precision,
                                sync_bn=train.sync_bn)

    def _seed(self, rank: int) -> None:
        """Seed torch and ``random``: the same on every rank for the initial weights, then
        per rank (different dropout masks and augmentations)."""
        seed = self.config.train.seed + 1000 * rank
        torch.manual_seed(seed)
        random.seed(seed)

    def _build_tokenizer(self, state: dict | None) -> Any:
        """The tokenizer: ``state``'s vocabulary (a resumed run, a later stage), else fitted
        on the training captions (the same on every rank)."""
        tokenizer = TOKENIZERS.build(self.preprocessing.tokenizer)
        if state is not None:
            tokenizer.load_state_dict(state["tokenizer"])
        elif not tokenizer.fitted:
            tokenizer.fit(caption for source in self.config.data.training_sources()
                          for caption in read_captions(source["shards"],
                                                       source.get("caption_key")))
        return tokenizer

    def _lock_towers(self, model: torch.nn.Module) -> None:
        """``train.lock_image`` / ``train.lock_text``: the tower frozen but its last layer
        groups, for the whole run (before LoRA-free parameters are counted)."""
        train = self.config.train
        for side, locked, unlocked in (
                ("image", train.lock_image, train.lock_image_unlocked_groups),
                ("text", train.lock_text, train.lock_text_unlocked_layers)):
            if not locked:  # an unlocked count alone: refused by the config's check
                continue
            require(model, TowerLockingModel, f"train.lock_{side}")
            getattr(model, f"lock_{side}_tower")(unlocked)

    def _say_trainable(self) -> None:
        """Log the trainable parameters when they change (the first epoch, a FreezeSchedule
        phase): what the optimizer updates now."""
        self.parameter_counts = counts = parameter_counts(*self._counted)
        if counts != self._said_counts:
            self._said_counts = counts
            logger.info("epoch %d: trainable parameters: %d of %d (%.2f%%)", self.epoch,
                        counts["trainable"], counts["total"],
                        100 * counts["trainable"] / max(counts["total"], 1))

    def _build_model_and_objective(self) -> tuple[torch.nn.Module, torch.nn.Module,
                                                  list[torch.nn.Module]]:
        """The model, the objective, and the attention constraints (CCR/CCS) that add their
        losses to the objective's."""
        model = MODELS.build(self.config.model, tokenizer=self.tokenizer)
        objective = OBJECTIVES.build(self.config.objective, tokenizer=self.tokenizer,
                                     model=model)
        if not isinstance(objective, torch.nn.Module):
            raise TypeError(f"objective {self.config.objective['type']!r} must be a "
                            f"torch.nn.Module")
        constraints = [CONSTRAINTS.build(c) for c in self.config.constraints]
        if constraints:
            require(model, CrossAttentionModel, "the attention constraints (constraints:)")
        return model, objective, constraints

    def _warn_split_overlaps(self) -> None:
        """Warn of evaluation shards that are training shards, or share sample keys with
        them (local shards: :func:`~mmgoal.data.pipeline.split_overlaps`)."""
        data = self.config.data
        train = [url for source in data.training_sources()
                 for url in expand_shards(source["shards"])]
        splits = {f"data.{name}": expand_shards(getattr(data, name).shards)
                  for name in ("val", "test") if getattr(data, name)}
        for sentence in split_overlaps(train, splits):
            logger.warning(sentence)

    def _build_train_set(self) -> Any:
        """The training set (``data.train``), its readers checked against the ranks and
        data workers that will share them."""
        data = self.config.data
        train_set = DATASETS.build(data.train, tokenizer=self.tokenizer,
                                   transform=self.train_transform, seed=self.config.train.seed,
                                   max_sample_bytes=data.max_sample_bytes)
        if hasattr(train_set, "check_readers"):
            train_set.check_readers(self.strategy.world_size, max(data.num_workers, 1))
        return train_set

    def _build_step(self, model: torch.nn.Module, objective: torch.nn.Module,
                    constraints: list[torch.nn.Module]) -> TrainingStep:
        """The training step the strategy wraps (and builds the optimizer of)."""
        if self.config.train.compile:
            compiled = compile_model(model)
            logger.info("torch.compile: %s (compiled at their first call)", ", ".join(compiled))
        chunk = self.config.train.grad_cache_chunk
        if chunk is not None and not self.strategy.supports_grad_cache:
            raise ValueError(f"train.grad_cache_chunk: {chunk} is supported by the torch, "
                             f"deepspeed and accelerate strategies, not by "
                             f"{type(self.strategy).__name__}; use one of them or remove "
                             f"grad_cache_chunk (docs/distributed.md, 'Gradient caching')")
        return TrainingStep(model, objective, constraints,
                            gather=self.config.train.gather_features,
                            scoring=self.config.train.scoring, grad_cache_chunk=chunk,
                            tile_rows=self.config.train.tile_rows,
                            tile_cols=self.config.train.tile_cols)

    def _log_setup(self) -> None:
        lr = ("from the DeepSpeed scheduler" if self.strategy.owns_schedule else
              f"{self.base_lrs[self.lr_group]:.3g} (scale_lr {self.config.train.scale_lr})")
        logger.info("%s; global batch %d = %d per rank x %d rank(s) x %d accumulation step(s); "
                    "%d steps per epoch (%d samples); base lr %s", self.strategy.describe(),
                    self.global_batch, self.train_set.batch_size, self.strategy.world_size,
                    self.accumulate_steps, self.steps_per_epoch, self.samples_per_epoch, lr)

    @property
    def optimizer(self):
        """The strategy's optimizer (its ``param_groups`` carry the learning rates)."""
        return self.strategy.optimizer

    def _scaled_optimizer_config(self) -> dict:
        """``optimizer`` with ``train.scale_lr`` applied: the configured lr is for
        ``train.reference_batch`` samples."""
        optimizer_cfg = self.config.optimizer
        rule = self.config.train.scale_lr
        if rule == "none":
            return optimizer_cfg
        reference = self.config.train.reference_batch or self.train_set.batch_size
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
            "epoch_steps_done": self.epoch_steps_done,
            "validation_due": self.validation_due,
            "best": dict(self.best),
            "validations_since_best": self.validations_since_best,
            "stopped_early": self.stopped_early,
            "skipped_samples": self.skipped_samples,
            "global_batch": self.global_batch,
            "train_seconds": self.train_seconds,
            "config": self.config.to_dict(),
            "mmgoal_version": mmgoal.__version__,
        }

    @property
    def train_seconds(self) -> float:
        """Seconds of training so far, over every segment of a resumed run."""
        return self.seconds_before + time.perf_counter() - self._segment_start

    def _restore(self, state: dict) -> None:
        saved_batch = state.get("global_batch", self.global_batch)
        if saved_batch != self.global_batch:
            raise ValueError(
                f"--resume: the checkpoint was trained with a global batch of {saved_batch}; "
                f"this run gives {self.global_batch} (data.train.batch_size "
                f"{self.train_set.batch_size} x {self.accumulate_steps} accumulation step(s) x "
                f"{self.strategy.world_size} rank(s)): set data.train.batch_size or "
                f"train.accumulate_steps so that the product is {saved_batch}")
        self.epoch, self.step = state["epoch"], state["step"]
        # micro-batches of the checkpoint's split of a step (a resume may change it, not the
        # global batch): the epoch's steps done, counted in this run's
        saved_accumulate = state.get("config", {}).get("train", {}).get(
            "accumulate_steps", self.accumulate_steps)
        self.batch_in_epoch = (state["batch_in_epoch"] // saved_accumulate
                               * self.accumulate_steps)
        # older checkpoints lack it: they were never written between an epoch's steps and end
        self.epoch_steps_done = state.get("epoch_steps_done", False)
        self.validation_due = state.get("validation_due", False)
        self.best = dict(state["best"])
        if self.config.train.best_metric not in self.best:
            chosen = next(key for key in self.best if key not in ("epoch", "step"))
            raise ValueError(f"--resume: the run chose best.pt by {chosen}; train.best_metric "
                             f"{self.config.train.best_metric} would compare other numbers "
                             f"with it: keep the run's best_metric")
        self.validations_since_best = state.get("validations_since_best", 0)
        self._set_aside_a_later_best()
        patience = self.config.train.early_stopping_patience  # a resume may change it
        self.stopped_early = state.get("stopped_early", False) and bool(
            patience and self.validations_since_best >= patience)
        self.skipped_samples = state["skipped_samples"]
        self.seconds_before = state.get("train_seconds", 0.0)
        if self.is_main:  # what the resumed run does again: the validation due, the test
            self.log.truncate_after(self.step, {
                *(["val"] if self.validation_due or self.epoch_steps_done else []),
                *(["test"] if not (self.work_dir / "report.json").is_file() else [])})
        logger.info("resumed at epoch %d, step %d", self.epoch, self.step)

    def _set_aside_a_later_best(self) -> None:
        """A best.pt that is not the resumed checkpoint's best (a run continued from an
        earlier epoch, docs/configs.md) is renamed, and validations from here choose
        best.pt again: the final test never takes weights of the abandoned progress."""
        metric, path = self.config.train.best_metric, self.checkpoint_dir / BEST
        later = None
        if self.is_main and path.is_file():
            held = peek_checkpoint(path)  # unreadable: the final test says so, not this
            value = self.best[metric] if held is None else (held.get("metrics") or {}).get(
                metric)
            if value != self.best[metric]:
                later = path.with_name(f"{BEST}.later")
                path.replace(later)
                logger.warning("%s (%s %s) is not the best of the checkpoint resumed (epoch "
                               "%d, step %d): set aside as %s; validations from here choose "
                               "best.pt", path, metric, value, self.epoch, self.step, later)
        if self.strategy.broadcast(later is not None):
            self.best = {metric: -math.inf, "epoch": -1}
            self.validations_since_best = 0

    def _check_resumed_state(self) -> None:
        """Refuse to continue from weights holding NaN/inf (collective): a checkpoint an
        older mmgoal wrote as its run diverged."""
        names = self.strategy.nonfinite_names()
        if names:
            raise ValueError(f"--resume: the checkpoint in {self.checkpoint_dir} holds NaN or "
                             f"inf in {describe_tensors(names)} (its run had diverged when it "
                             f"was written); it cannot be continued: start again with a lower "
                             f"learning rate, or from best.pt with load_from")

    def _load_weights(self, model: torch.nn.Module, state: dict, path: str) -> dict[str, list]:
        """``load_from``: start ``model`` from another run's weights; returns and logs what
        either side lacks (:func:`~mmgoal.runs.checkpoint.load_matching_weights`)."""
        saved = ((state.get("config") or {}).get("model") or {}).get("type")
        wanted = self.config.model["type"]
        if saved is not None and saved != wanted:
            raise ValueError(f"load_from {path}: a {saved} checkpoint cannot start a {wanted} "
                             f"model; give a checkpoint of a {wanted} run")
        handoff = load_matching_weights(model, state["model"], f"load_from {path}")
        logger.info("model weights loaded from %s", path)
        if handoff["dropped"]:
            logger.warning("load_from: dropped %d checkpoint tensors this model has no place "
                           "for: %s", len(handoff["dropped"]), summarise_keys(handoff["dropped"]))
        if handoff["missing"]:
            logger.warning("load_from: %d tensors of this model are not in the checkpoint and "
                           "keep their initial values: %s", len(handoff["missing"]),
                           summarise_keys(handoff["missing"]))
        return handoff

    def save(self) -> None:
        """A resumable checkpoint (collective: every rank calls it)."""
        self.strategy.save(self.checkpoint_dir, self.state_dict())

    def save_weights(self, name: str, **extra: Any) -> None:
        """The float32 weights (+ tokenizer, config) as ``checkpoints/<name>`` (collective)."""
        self._write_weights(name, self.strategy.full_state_dict(), **extra)

    def _write_weights(self, name: str, weights: dict | None, **extra: Any) -> None:
        """Rank 0 writes ``weights`` (its ``full_state_dict()``); every rank waits. Weights
        holding NaN/inf stop the run instead (:class:`NonFiniteStateError`)."""
        self.strategy.check_finite(self.checkpoint_dir, self.step, weights)
        if self.is_main:
            save_checkpoint({"model": weights, "tokenizer": self.tokenizer.state_dict(),
                             "config": self.config.to_dict(), **extra},
                            self.checkpoint_dir / name)
        self.strategy.barrier()

    # -------------------------------------------------------------- training
    def _set_lr(self) -> float:
        groups = self.strategy.param_groups()
        if not self.strategy.owns_schedule:
            factor = self.schedule.factor(self.step)
            for group, base in zip(groups, self.base_lrs):
                group["lr"] = base * factor
        return groups[self.lr_group]["lr"]

    def _loader(self) -> torch.utils.data.DataLoader:
        self.train_set.set_epoch(self.epoch)
        workers = self.config.data.num_workers
        # The workers' base seed comes from the seed and epoch: drawn from torch's state, a
        # run resumed inside an epoch would draw it between two steps and shift every later
        # draw (dropout, CCR's query words, ITM's seeds)
        generator = torch.Generator().manual_seed(
            self.config.train.seed * 1_000_003 + self.epoch * 1_009 + self.strategy.rank)
        return torch.utils.data.DataLoader(
            self.train_set, batch_size=None, num_workers=workers, persistent_workers=False,
            pin_memory=self.strategy.device.type == "cuda", generator=generator,
            worker_init_fn=functools.partial(start_data_worker, self._release_workers))

    def _stop_while_waiting(self, signal_name: str, trained: bool) -> None:
        """After a stop signal ended a wait for data: a checkpoint when ``trained`` (this
        run has done steps), else a word on why there is none."""
        self._release_workers.set()  # stuck workers end now, not after the loader's 5 s wait
        if trained:
            self.save()
            logger.warning("received %s while waiting for data: stopped at epoch %d, step %d "
                           "with a checkpoint; continue with --resume", signal_name, self.epoch,
                           self.step)
        elif self.step:
            logger.warning("received %s while waiting for data, before this run's first step: "
                           "stopped; the checkpoint of step %d is the latest", signal_name,
                           self.step)
        else:
            logger.warning("received %s while waiting for data, before the first step: no "
                           "checkpoint written (nothing was trained)", signal_name)

    def _stop_during_validation(self) -> None:
        """After a stop signal ended a validation (one process): the checkpoint of the state
        before it (the epoch's steps done, not its end), from which --resume validates again."""
        self.save()
        which = (f"step {self.step}'s validation" if self.validation_due else
                 f"epoch {self.epoch}'s validation" if self.epoch_steps_done
                 else "the validation before training")
        logger.warning("received %s during %s: dropped it and stopped at epoch %d, step %d "
                       "with a checkpoint; --resume validates again and continues",
                       signal.Signals(self.signals.received).name, which, self.epoch, self.step)

    def fit(self) -> dict:
        """Train the configured epochs, then test the best checkpoint; returns the report
        (``report.json``). A resumed run already done returns the report it wrote."""
        report_file = self.work_dir / "report.json"
        try:
            if self.step and (self.epoch >= self.config.train.epochs or self.stopped_early):
                patience = self.config.train.early_stopping_patience
                logger.warning(
                    "%s: nothing is left to train (train on with --cfg-options %s)%s",
                    f"the run stopped early at step {self.step}, {patience} validations "
                    f"without a gain" if self.stopped_early else
                    f"the run has trained {self.epoch} epoch(s) and train.epochs is "
                    f"{self.config.train.epochs}",
                    f"train.early_stopping_patience={patience + 1} or more, or 0" if
                    self.stopped_early else f"train.epochs=N, N > {self.epoch}",
                    "; its report stands" if report_file.is_file() else "")
                if report_file.is_file():
                    return self.strategy.broadcast(json.loads(read_text(
                        report_file, "run report")) if self.is_main else None)
            self.log.open(self.config.to_dict(), self.step)
            if not self._train():
                return {"interrupted": True, "epoch": self.epoch, "step": self.step}
            return self._final_report(self.train_seconds)
        finally:
            self.log.close()

    def _train(self) -> bool:
        """The epochs left, under the stop-signal handlers; False when a signal stopped them.
        On ``IncompleteSplitError`` (a validation's split unreadable) it checkpoints first."""
        self._segment_start = time.perf_counter()
        self._release_workers.clear()
        with self.signals.installed():
            try:
                for hook in self.hooks:
                    hook.before_train(self)
                if self.config.train.eval_before_training and self.epoch == self.step == 0:
                    self._validate(-1, self.strategy.full_state_dict())  # collective
                first_step = self.step
                while self.epoch < self.config.train.epochs and not self.stopped_early:
                    try:
                        finished = self._train_epoch()
                    except StopWhileWaitingForData as stop:
                        self._stop_while_waiting(str(stop), trained=self.step > first_step)
                        finished = False
                    if not finished:
                        return False
                for hook in self.hooks:
                    hook.after_train(self)
            except EvaluationStopped:
                self._stop_during_validation()
                return False
            except IncompleteSplitError:
                # no metrics over part of the split (they would pick best.pt); the state
                # before the validation is kept, and --resume validates again
                self.save()
                raise
            finally:
                self._release_workers.set()
        return True

    def _window(self, batches: Iterator[dict]) -> Iterator[dict]:
        """The next ``accumulate_steps`` micro-batches, counted as the strategy takes them."""
        for _ in range(self.accumulate_steps):
            batch = self.signals.next_batch(batches)
            if batch is None:
                return
            self.skipped_samples += batch["skipped"]
            for name, count in batch.get("source_counts", {}).items():
                self.source_counts[name] = self.source_counts.get(name, 0) + count
            self.batch_in_epoch += 1
            self._samples_since_log += len(batch["captions"]) * self.strategy.world_size
            yield batch

    def _train_epoch(self) -> bool:
        """One epoch (after a resume, its rest); False when stopped by a signal, and
        ``EvaluationStopped`` when one ended its validation (in one process)."""
        self.model.train()  # before the hooks, which may put frozen parts in eval mode
        for hook in self.hooks:
            hook.before_epoch(self)
        self._say_trainable()
        if not self.epoch_steps_done and not self._train_steps():
            return False
        self._end_of_epoch()
        return True

    def _train_steps(self) -> bool:
        """The epoch's steps (those left, after a resume); False when stopped by a signal."""
        cfg = self.config.train
        micro_batches = self.steps_per_epoch * self.accumulate_steps
        bar = progress_bar(total=self.steps_per_epoch,
                           initial=self.step % self.steps_per_epoch, desc=f"epoch {self.epoch}",
                           unit="step", dynamic_ncols=True, show=cfg.progress and self.is_main)
        batches = iter(self._loader())
        # Resuming inside an epoch: replay the data order, skip the work.
        for _ in range(self.batch_in_epoch):
            if self.signals.next_batch(batches) is None:
                break
        if (self.validation_due and self.config.data.val  # what a stop dropped
                and not self._validate_at_step()):
            bar.close()
            return True
        nonfinite_run = 0
        tick, self._samples_since_log = time.perf_counter(), 0
        tick_step = self.step
        while self.batch_in_epoch < micro_batches:
            lr = self._set_lr()
            window_start = self.batch_in_epoch, self.skipped_samples
            try:
                result = self.strategy.train_step(self._window(batches))
            except StopWhileWaitingForData:  # the checkpoint holds the steps done, no more
                self.batch_in_epoch, self.skipped_samples = window_start
                raise
            if not result.micro_batches:  # the data ran out before the epoch's steps
                self.epoch_steps_done = True
                break
            outputs = {**result.outputs, "nonfinite": result.nonfinite}
            if result.nonfinite:
                nonfinite_run += 1
                logger.warning("non-finite loss or gradient at step %d: step skipped", self.step)
                # The skipped forward still moved BatchNorm statistics, maybe to inf.
                self.strategy.check_finite(self.checkpoint_dir, self.step)
                if nonfinite_run >= cfg.max_nonfinite_steps:
                    raise FloatingPointError(
                        f"{nonfinite_run} non-finite losses in a row (step {self.step}; a NaN/inf "
                        f"loss or gradient); lower the learning rate, check the data, or raise "
                        f"train.max_nonfinite_steps")
            else:
                nonfinite_run = 0
            self.step += 1
            # from the epoch's last step on, a checkpoint resumes at the epoch's end, without
            # reading its data again
            self.epoch_steps_done = self.batch_in_epoch == micro_batches
            for hook in self.hooks:
                hook.after_step(self, outputs)
            if self.step % cfg.log_every == 0:
                elapsed = time.perf_counter() - tick
                total_steps = self.config.train.epochs * self.steps_per_epoch
                record = {"type": "train", "epoch": self.epoch, "step": self.step, "lr": lr,
                          "samples_per_s": self._samples_since_log / max(elapsed, 1e-9),
                          # the steps left at this window's pace (validations not counted)
                          "total_steps": total_steps,
                          "eta_s": (total_steps - self.step) * elapsed / (self.step - tick_step),
                          "skipped_samples": self.skipped_samples,
                          **{f"samples_{name}": n for name, n in self.source_counts.items()}}
                record.update({k: float(v) for k, v in result.outputs.items()})
                if self.strategy.device.type == "cuda":
                    record["max_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
                self.log.write(record)
                bar.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{lr:.2e}",
                                img_s=f"{record['samples_per_s']:.0f}")
                tick, self._samples_since_log = time.perf_counter(), 0
                tick_step = self.step
            bar.update(1)
            self.validation_due = bool(  # the epoch's end validates its last step
                cfg.eval_every_steps and self.config.data.val and not self.epoch_steps_done
                and self.step % cfg.eval_every_steps == 0)
            every = cfg.checkpoint_every_steps
            if every and self.step % every == 0:
                self.save()  # a kill during the validation due: --resume does it first
            if self.validation_due and not self._validate_at_step():
                break
            # One agreement per step: a signal on any rank stops every rank after this step.
            if self.strategy.agree(self.signals.received is not None)[0]:
                bar.close()
                self.save()
                logger.warning("stopped at epoch %d, step %d; continue with --resume",
                               self.epoch, self.step)
                return False
        bar.close()
        return True

    def evaluation_model(self, weights: dict[str, torch.Tensor] | None,
                         current: bool = False) -> torch.nn.Module:
        """A float32 model holding rank 0's full ``weights`` (``None`` on other ranks) on
        every rank (a collective): the trained model where the strategy loads them into it
        (:meth:`Strategy.evaluation_weights`), else a copy. ``current``: the weights are
        the trained model's own, so a plain module evaluates itself, nothing sent."""
        if current and self.strategy.plain_module:
            return self.model
        weights = self.strategy.broadcast_weights(weights)  # once: rank 0's on every rank
        copy_weights = self.strategy.evaluation_weights(weights)
        if copy_weights is None:
            return self.model
        model = MODELS.build(self.config.model, tokenizer=self.tokenizer)
        model.load_state_dict(copy_weights)
        return model.to(self.strategy.device)

    def _end_of_epoch(self) -> None:
        """Validation (and best.pt), the ``after_epoch`` hooks, then the epoch's checkpoint
        (kept as ``epoch_<epoch>.pt`` too, with ``train.keep_epochs``)."""
        epoch = self.epoch
        metrics: dict[str, float] = {}
        every, every_steps = self.config.train.eval_every, self.config.train.eval_every_steps
        last_epoch = epoch + 1 == self.config.train.epochs
        due = ((every and ((epoch + 1) % every == 0 or last_epoch))
               or (every_steps and self.step % every_steps == 0))  # a step's, left to here
        if self.config.data.val and due and not self.stopped_early:
            # (stopped early: by a validation with no step since)
            metrics = self._validate_and_keep()
        for hook in self.hooks:  # still in the epoch; what they change is checkpointed below
            hook.after_epoch(self, metrics)
        self.epoch += 1
        self.batch_in_epoch = 0
        self.epoch_steps_done = False
        self.save()
        if self.config.train.keep_epochs:
            self.strategy.keep_epoch(self.checkpoint_dir, epoch, self.config.train.keep_epochs)

    def _validate_at_step(self) -> bool:
        """The validation due by ``train.eval_every_steps`` (and best.pt); False when it
        stopped the run early."""
        self._validate_and_keep()
        self.validation_due = False
        return not self.stopped_early

    def _validate_and_keep(self) -> dict[str, float]:
        """Validate the model as it is (collective), keep it as best.pt where it gains
        ``train.best_metric``, and stop the run early after ``early_stopping_patience``
        validations without a gain."""
        train = self.config.train
        weights = self.strategy.full_state_dict()  # one gather: the evaluation copy, best.pt
        metrics = self._validate(self.epoch, weights)
        if train.best_metric not in metrics:
            raise ValueError(f"train.best_metric {train.best_metric} is not a validation "
                             f"metric; they are {', '.join(sorted(metrics))}")
        if metrics[train.best_metric] > self.best[train.best_metric]:
            self.best = {train.best_metric: metrics[train.best_metric], "epoch": self.epoch,
                         **({"step": self.step} if train.eval_every_steps else {})}
            self.validations_since_best = 0
            self._write_weights(BEST, weights, epoch=self.epoch, metrics=metrics)
        else:
            self.validations_since_best += 1
        patience = train.early_stopping_patience
        if patience and self.validations_since_best >= patience and not self.stopped_early:
            self.stopped_early = True
            logger.info("early stopping at epoch %d, step %d: %d validations without a gain "
                        "of %s (best %.4g, epoch %d)", self.epoch, self.step, patience,
                        train.best_metric, self.best[train.best_metric], self.best["epoch"])
        return metrics

    def _validate(self, epoch: int, weights: dict[str, torch.Tensor] | None) -> dict[str, float]:
        """``weights`` (rank 0's ``full_state_dict()``) on ``data.val``, evaluated by every
        rank (collective) and logged by rank 0 as ``epoch``'s (-1: before training).

        On ``EvaluationStopped`` the random state is restored, so the validation --resume
        redoes draws what this one drew (such as its DataLoader's worker seed).
        """
        self.strategy.check_finite(self.checkpoint_dir, self.step, weights)
        before = rng_state()
        try:
            with self.signals.validation() as stop:
                # the extended COCO protocols are the test split's (5K test), not validation's
                model = self.evaluation_model(weights, current=True)
                metrics = self.evaluate("val", model, across_ranks=True, protocols=["coco"],
                                        stop=stop, zeroshot=True)
        except EvaluationStopped:
            set_rng_state(before)
            raise
        if self.is_main:
            self.log.write({"type": "val", "epoch": epoch, "step": self.step, **metrics})
            logger.info("epoch %d val%s: %s", epoch, " (before training)" if epoch < 0 else "",
                        format_metrics(metrics))
        return metrics

    def evaluate(self, split: str, model: torch.nn.Module | None = None,
                 across_ranks: bool = False, protocols: list[str] | None = None,
                 stop: Callable[[], bool] | None = None, zeroshot: bool = False
                 ) -> dict[str, float]:
        """The metrics of ``model`` (default: the trained one) on ``val`` or ``test``, and
        with ``zeroshot`` on ``evaluation.zeroshot``'s set (rank 0 classifies it), by
        :func:`~mmgoal.evaluation.request.evaluate` (the others as its request's)."""
        split_cfg = getattr(self.config.data, split)
        if not split_cfg:
            raise ValueError(f"the config has no 'data.{split}' section to evaluate on")
        where = self.config.evaluation.zeroshot
        request = config_request(
            self.config.data, split_cfg, self.config.evaluation,
            zeroshot=(read_classification_set(where["root"], where["split"])
                      if zeroshot and where and self.is_main else None),
            protocols=protocols, across_ranks=across_ranks,
            progress=self.config.train.progress and self.is_main, stop=stop)
        member = Member(model if model is not None else self.model, self.eval_transform,
                        self.tokenizer)
        return evaluate(member, request).metrics

    def _final_report(self, seconds: float) -> dict:
        report: dict[str, Any] = {"epochs": self.epoch, "steps": self.step,
                                  "train_seconds": seconds, "best": self.best,
                                  "skipped_samples": self.skipped_samples,
                                  "parameters": self.parameter_counts}
        if self.config.data.test:
            current = self.best["epoch"] < 0  # no validation: the trained model as it is
            if current:
                weights = self.strategy.full_state_dict()  # collective
            else:  # best.pt exists, and every rank knows it
                weights = (load_checkpoint(self.checkpoint_dir / BEST)["model"]
                           if self.is_main else None)
            test = self.evaluate("test", self.evaluation_model(weights, current),
                                 across_ranks=True)  # collective
            if self.is_main:
                report["test"] = test
                report["test_set"] = shard_listing(self.config.data.test.shards)
                self.log.write({"type": "test", "step": self.step, **report["test"]})
                self.log.note(f"test metrics of the best epoch ({self.best['epoch']}), "
                              f"{seconds:.0f}s of training:\n{metrics_table(test)}")
        if self.is_main:
            write_text(self.work_dir / "report.json", strict_json.dumps(report, indent=2))
        return self.strategy.broadcast(report)
