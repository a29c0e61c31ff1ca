"""DeepSpeed: ZeRO stages 0-3, bf16/fp16 mixed precision, accumulation, clipping, checkpoints.

The config is made from the mmgoal config, a given JSON merged under it; a tag
``checkpoints/deepspeed/<tag>/`` holds DeepSpeed's files, ``trainer_state.pt`` and
``weights.pt``, every file read weights-only (docs/distributed.md, "DeepSpeed config" and
"Checkpoints, resume, export").
"""

from __future__ import annotations

import contextlib
import copy
import glob
import json
import logging
import os
import pickle
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from mmgoal.config import Precision
from mmgoal.devices import precision_dtype
from mmgoal.distributed import (
    all_objects,
    launched_rank,
    launched_world_size,
    process_group_backend,
    rng_state,
)
from mmgoal.engine.optimizers import build_optimizer
from mmgoal.engine.strategies.base import Strategy, cpu_float_state, prune_except
from mmgoal.extras import require_extra
from mmgoal.files import read_text
from mmgoal.registry import STRATEGIES
from mmgoal.runs.checkpoint import load_checkpoint, save_checkpoint
from mmgoal.runs.run_dir import (
    DEEPSPEED,
    DEEPSPEED_WEIGHTS,
    LATEST,
    latest_deepspeed_tag,
    write_pointer,
)

logger = logging.getLogger(__name__)

TRAINER_STATE = "trainer_state.pt"
UNIVERSAL_SUFFIX = "-universal"
# What DeepSpeed's ds_to_universal converter requires of a checkpoint (beyond Megatron's
# tensor-parallel patterns, which mmgoal models do not have).
UNIVERSAL_INFO = {"universal_checkpoint_info": {"universal_checkpoint_version": 0.4}}
# Run in a subprocess by load_universal: DeepSpeed's converter, reading weights-only; its
# arguments are the command line's, exit status 2 when a file is refused.
CONVERT_TO_UNIVERSAL = ("import sys; from mmgoal.engine.strategies.deepspeed import "
                        "convert_to_universal; sys.exit(convert_to_universal())")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pickled_deepspeed_classes() -> list[type]:
    """The classes DeepSpeed pickles into its optimizer states, allowed when they are read:
    each is rebuilt from numbers alone and runs no code on load (found with
    ``torch.serialization.get_unsafe_globals_in_checkpoint`` on ZeRO 0-3 checkpoints in
    fp32, bf16 and fp16, and their universal conversions).
    """
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, fragment_address, LossScaler, DynamicLossScaler]


class RefusedCheckpointFile(ValueError):
    """A DeepSpeed file holds something other than tensors and plain data."""


def refused_file_error(file: str | os.PathLike) -> RefusedCheckpointFile:
    """The error for a DeepSpeed file the weights-only unpickler refused."""
    found = ""
    with contextlib.suppress(Exception):  # only a torch.save zip file can be listed
        found = f" ({', '.join(torch.serialization.get_unsafe_globals_in_checkpoint(file))})"
    return RefusedCheckpointFile(
        f"DeepSpeed checkpoint file {file} holds something other than tensors and plain "
        f"data{found}; mmgoal reads DeepSpeed files weights-only and will not run what a "
        f"pickle asks for. DeepSpeed did not write it, or wrote a class mmgoal does not "
        f"know: resume only from checkpoints you trust, or start afresh with load_from: "
        f"a weights.pt you trust")


@contextlib.contextmanager
def weights_only_loading() -> Iterator[None]:
    """Inside, every ``torch.load`` reads weights-only, allowing :func:`pickled_deepspeed_classes`
    (DeepSpeed's universal loader and converter call ``torch.load`` outside its engine).

    Raises:
        RefusedCheckpointFile: a file holds something other than tensors and plain data.
    """
    torch_load = torch.load

    # pickle_module, weights_only and unpickler arguments are DeepSpeed's choices for its
    # full unpickler; the weights-only one takes none of them.
    def weights_only_load(file, map_location=None, *_, mmap=None, **__):
        with torch.serialization.safe_globals(pickled_deepspeed_classes()):
            try:
                return torch_load(file, map_location=map_location, weights_only=True, mmap=mmap)
            except pickle.UnpicklingError:
                raise refused_file_error(file) from None

    torch.load = weights_only_load
    try:
        yield
    finally:
        torch.load = torch_load


@contextlib.contextmanager
def scalar_parameters_broadcast() -> Iterator[None]:
    """Inside, a DeepSpeed engine's first broadcast takes 0-dim parameters (``logit_scale``),
    which it cannot view as bytes: each is one element for that broadcast alone."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    broadcast_model = DeepSpeedEngine._broadcast_model

    def broadcast_with_scalars(engine: DeepSpeedEngine) -> None:
        scalars = [p for p in engine.module.parameters() if p.dim() == 0]
        for param in scalars:
            param.data = param.data.reshape(1)
        try:
            broadcast_model(engine)
        finally:
            for param in scalars:
                param.data = param.data.reshape(())

    DeepSpeedEngine._broadcast_model = broadcast_with_scalars
    try:
        yield
    finally:
        DeepSpeedEngine._broadcast_model = broadcast_model


def convert_to_universal() -> int:
    """``python -m deepspeed.checkpoint.ds_to_universal`` (arguments from the command line),
    every file read weights-only (its forked workers too). Returns the exit status: 0, or 2
    with the error on stderr when a file is refused."""
    from deepspeed.checkpoint import ds_to_universal

    try:
        with weights_only_loading():
            ds_to_universal.main(ds_to_universal.parse_arguments())
    except RefusedCheckpointFile as error:
        print(error, file=sys.stderr)
        return 2
    return 0


def read_deepspeed_json(config: str | dict | None) -> dict:
    """A DeepSpeed config from a JSON file path or a mapping ({} when None)."""
    if config is None:
        return {}
    if isinstance(config, dict):
        return copy.deepcopy(config)
    path = Path(config)
    if not path.is_file():
        raise FileNotFoundError(f"DeepSpeed config {path} does not exist")
    try:
        return json.loads(read_text(path, "DeepSpeed config"))
    except ValueError as error:
        raise ValueError(f"DeepSpeed config {path} is not valid JSON ({error})") from error


def merge_deepspeed_config(user: dict, micro_batch: int, accumulate_steps: int, world_size: int,
                           clip_grad: float | None, zero_stage: int, precision: str) -> dict:
    """The DeepSpeed config: ``user``'s keys, the mmgoal values where it has none or "auto".

    Raises:
        ValueError: a batch size in ``user`` contradicts the mmgoal config.
    """
    cfg = copy.deepcopy(user)
    for key, value in (("train_micro_batch_size_per_gpu", micro_batch),
                       ("gradient_accumulation_steps", accumulate_steps),
                       ("train_batch_size", micro_batch * accumulate_steps * world_size)):
        given = cfg.get(key, "auto")
        if given not in ("auto", value):
            raise ValueError(
                f"the DeepSpeed config sets {key}={given}, but the mmgoal config gives {value} "
                f"(data.train.batch_size per rank x train.accumulate_steps x {world_size} "
                f"ranks); set it in one place or write \"auto\" in the JSON")
        cfg[key] = value
    if cfg.get("gradient_clipping", "auto") == "auto":
        cfg["gradient_clipping"] = float(clip_grad or 0.0)
    cfg.setdefault("zero_optimization", {})["stage"] = zero_stage
    if precision != "fp32":
        cfg.setdefault(precision, {})["enabled"] = True
    cfg.setdefault("zero_allow_untested_optimizer", True)
    cfg.setdefault("steps_per_print", 2**31 - 1)
    return cfg



def say_cpu_extension_build() -> bool:
    """Say, before it happens, that DeepSpeed on a CPU compiles its shared-memory extension
    (``deepspeed_shm_comm``) on its first run on a machine, about a minute without a word
    from it, and where the result is kept; True when it said so (not built yet)."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    if glob.glob(os.path.join(root, "**", "deepspeed_shm_comm", "*.so"), recursive=True):
        return False
    logger.warning("DeepSpeed compiles its CPU extension (deepspeed_shm_comm) on its first "
                   "run on this machine: about a minute on 2 cores, once; it is kept in %s "
                   "(TORCH_EXTENSIONS_DIR sets where; make venv sets it to .venv/)", root)
    return True

@STRATEGIES.register("deepspeed")
class DeepSpeedStrategy(Strategy):
    """Train through ``deepspeed.initialize`` (the ``deepspeed`` extra; module docstring).

    Args:
        zero_stage: ZeRO stage 0, 1, 2 or 3 (when the JSON sets none).
        precision: ``fp32``, ``bf16`` or ``fp16`` (dynamic loss scaling; GPUs only),
            when the JSON enables neither bf16 nor fp16 (default: ``train.precision``).
        config: a DeepSpeed JSON path or mapping merged over the generated config.
        device: ``train.device``; it must be DeepSpeed's accelerator (``DS_ACCELERATOR``).
        timeout_minutes: how long a collective waits for a rank before failing.
    """

    supports_grad_cache = True

    def __init__(self, zero_stage: Literal[0, 1, 2, 3] = 2, precision: Precision = "fp32",
                 config: str | dict | None = None, device: str | torch.device = "auto",
                 timeout_minutes: float = 60.0) -> None:
        require_extra("deepspeed", "strategy: {type: deepspeed}")
        self.user_config = read_deepspeed_json(config)
        self.zero_stage = self.user_config.get("zero_optimization", {}).get("stage", zero_stage)
        if self.user_config.get("bf16", {}).get("enabled"):
            precision = "bf16"
        elif self.user_config.get("fp16", {}).get("enabled"):
            precision = "fp16"
        super().__init__(device, precision, timeout_minutes)
        self.plain_module = self.zero_stage < 3 and precision == "fp32"

    def join_process_group(self, timeout_minutes: float) -> None:
        import datetime

        import deepspeed
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator().device_name()
        if accelerator != self.device.type:
            raise ValueError(f"DeepSpeed runs on its accelerator, {accelerator}, but "
                             f"train.device is {self.device}; use train.device: auto, or set "
                             f"DS_ACCELERATOR=cpu to train on the CPU")
        if launched_world_size() == 1 and not dist.is_initialized():
            # DeepSpeed always needs a process group: one process makes a group of one.
            os.environ.setdefault("RANK", "0")
            os.environ.setdefault("LOCAL_RANK", "0")
            os.environ.setdefault("WORLD_SIZE", "1")
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        elif launched_rank() == 0:
            say_cpu_extension_build()
        deepspeed.init_distributed(dist_backend=process_group_backend(self.device),
                                   verbose=False,
                                   timeout=datetime.timedelta(minutes=timeout_minutes))

    def describe(self) -> str:
        return (f"DeepSpeed ZeRO-{self.zero_stage} {self.precision}, {self.world_size} "
                f"process(es)")

    def setup(self, module: nn.Module, optimizer_cfg: dict, micro_batch: int,
              accumulate_steps: int, clip_grad: float | None) -> None:
        import deepspeed

        self.accumulate_steps = accumulate_steps
        # Each part of a micro-batch (TrainingStep.parts: under train.grad_cache_chunk, each
        # chunk) is one of DeepSpeed's micro-batches (docs/distributed.md, "Gradient caching")
        self.chunks, part_size = module.part_shape(micro_batch)
        self.config = merge_deepspeed_config(
            self.user_config, micro_batch=part_size,
            accumulate_steps=accumulate_steps * self.chunks, world_size=self.world_size,
            clip_grad=clip_grad, zero_stage=self.zero_stage, precision=self.precision)
        self.client_optimizer = (None if "optimizer" in self.config else
                                 build_optimizer(optimizer_cfg, module.model, module.objective))
        parameters = (None if self.client_optimizer is not None else
                      [p for p in module.parameters() if p.requires_grad])
        with scalar_parameters_broadcast():
            self.engine, self.optimizer, _, _ = deepspeed.initialize(
                model=module, optimizer=self.client_optimizer, model_parameters=parameters,
                config=self.config)
        self.module = self.engine.module
        self.device = self.engine.device
        self.trainable = {n for n, p in self.module.named_parameters() if p.requires_grad}
        self.dtype = precision_dtype(self.precision)

    @property
    def owns_schedule(self) -> bool:
        return "scheduler" in self.config

    def param_groups(self) -> list[dict]:
        return (self.client_optimizer or self.optimizer).param_groups

    def micro_step(self, batch: dict, objective: nn.Module,
                   last: bool) -> tuple[dict[str, torch.Tensor], bool]:
        if self.dtype != torch.float32:
            batch = {k: v.to(self.dtype) if isinstance(v, torch.Tensor) and v.is_floating_point()
                     else v for k, v in batch.items()}
        parts = self.module.parts(batch, objective, self.loss_scale())
        if self.zero_stage == 3 and parts.cache is not None and parts.cache.direct:
            raise ValueError(
                f"train.grad_cache_chunk under DeepSpeed ZeRO-3: the objective reads "
                f"parameters other than through the features "
                f"({', '.join(self.parameter_names(p for p, _ in parts.cache.direct))}), "
                f"whose cached gradients ZeRO-3's partitioned parameters cannot take; use "
                f"ZeRO stage 0-2 or the torch strategy (docs/distributed.md, 'Gradient "
                f"caching')")
        outputs = parts.outputs
        nonfinite = outputs is not None and self.loss_is_nonfinite(outputs["loss"])
        # Each part is one of DeepSpeed's micro-batches (gradient_accumulation_steps are
        # train.accumulate_steps times the chunks of a batch): the loss divided by the
        # accumulation steps alone, then engine.step(), which applies the update at the
        # window's last part only. Where a part is missing (a short last batch) or dropped
        # (a non-finite loss inside a window) a zero loss keeps DeepSpeed's count.
        for index in range(self.chunks):
            loss = None
            if index < len(parts.replays) and not nonfinite:
                result = self.engine(batch, objective, replay=parts.replays[index])
                if outputs is None:  # the one part without gradient caching
                    outputs, nonfinite = result, self.loss_is_nonfinite(result["loss"])
                loss = None if nonfinite else result["loss"]
            if nonfinite and self.accumulate_steps == 1:
                break  # the step is skipped before DeepSpeed counted anything
            loss = self.zero_loss() if loss is None else loss
            self.engine.backward(loss / self.accumulate_steps, scale_wrt_gas=False)
            if not self.engine.is_gradient_accumulation_boundary():
                self.engine.step()
        return outputs, nonfinite

    def zero_loss(self) -> torch.Tensor:
        """A loss of 0 on every trainable parameter: a backward that counts as one of
        DeepSpeed's micro-batches and adds nothing (a dropped micro-batch or chunk)."""
        return sum((p * 0).sum() for p in self.module.parameters() if p.requires_grad)

    def loss_scale(self) -> float:
        return (float(getattr(self.engine.optimizer, "loss_scale", 1.0))
                if self.precision == "fp16" else 1.0)

    def parameter_names(self, params) -> list[str]:
        """The names of ``params`` in the training module."""
        wanted = {id(p) for p in params}
        return [name for name, p in self.module.named_parameters() if id(p) in wanted]

    def _check_trainable(self) -> None:
        if self.zero_stage == 0:
            return
        now = {n for n, p in self.module.named_parameters() if p.requires_grad}
        if now != self.trainable:
            changed = sorted(now ^ self.trainable)
            raise RuntimeError(
                f"the trainable parameters changed after DeepSpeed ZeRO-{self.zero_stage} "
                f"partitioned them ({', '.join(changed[:5])}{'...' if len(changed) > 5 else ''}); "
                f"ZeRO fixes the trainable set at start: freeze with FreezeSchedule only under "
                f"strategy ddp/single or zero_stage 0")

    def apply_step(self, window_ok: bool) -> bool:
        if not window_ok and self.accumulate_steps == 1:
            return False
        self._check_trainable()
        self.engine.step()
        if self.precision == "fp16":
            return window_ok  # overflow skips are how dynamic loss scaling finds its scale
        return window_ok and self.engine.was_step_applied()

    # ------------------------------------------------------------ checkpoints
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        model = self.module.model
        if self.zero_stage == 0:
            return super().full_state_dict()
        import deepspeed
        from deepspeed.utils import safe_get_full_fp32_param

        full: dict[str, torch.Tensor] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            value = safe_get_full_fp32_param(param)  # collective: every rank calls it
            if value is None:  # not optimised (frozen at start): the module's own copy
                with deepspeed.zero.GatheredParameters([param], enabled=self.zero_stage == 3):
                    value = param.detach().float().clone()
            full[name] = value
        if not self.is_main:
            return None
        return cpu_float_state({k: full.get(k, v) for k, v in model.state_dict().items()})

    def local_state(self) -> dict[str, torch.Tensor]:
        state = super().local_state()
        if self.zero_stage == 3:
            # ZeRO-3 parameters are empty placeholders: each rank checks its own partition.
            for prefix, part in (("", self.model), ("objective.", self.module.objective)):
                state.update({prefix + name: p.ds_tensor for name, p in part.named_parameters()
                              if hasattr(p, "ds_tensor")})
        return state

    def save(self, directory: Path, state: dict) -> None:
        root = directory / DEEPSPEED
        tag = f"epoch{state['epoch']:04d}-step{state['step']:09d}"
        in_use = latest_deepspeed_tag(directory)
        if in_use is not None and in_use.name == tag:  # never overwrite the checkpoint in use
            tag += "-again"
        weights = self.full_state_dict()
        self.check_finite(directory, state["step"], weights)
        rngs = all_objects(rng_state())
        self.engine.save_checkpoint(str(root), tag=tag, client_state=UNIVERSAL_INFO,
                                    save_latest=False)
        if self.is_main:
            save_checkpoint({"model": weights, "tokenizer": state["tokenizer"],
                             "config": state["config"], "epoch": state["epoch"],
                             "step": state["step"]}, root / tag / DEEPSPEED_WEIGHTS)
            save_checkpoint({**state, "rng": rngs, "world_size": self.world_size,
                             "zero_stage": self.zero_stage, "precision": self.precision},
                            root / tag / TRAINER_STATE)
        self.barrier()
        if self.is_main:
            write_pointer(root / LATEST, tag)
            prune_except(root, tag)
        self.barrier()

    def latest_tag(self, directory: Path) -> Path:
        """The newest complete tag's folder in ``directory`` (a run's ``checkpoints/``)."""
        folder = latest_deepspeed_tag(directory)
        if folder is None:
            raise FileNotFoundError(f"--resume: no complete DeepSpeed checkpoint under "
                                    f"{directory / DEEPSPEED}; start without --resume or point "
                                    f"--work-dir at the run")
        return folder

    def read_state(self, directory: Path) -> dict:
        return load_checkpoint(self.latest_tag(directory) / TRAINER_STATE)

    def load(self, directory: Path, state: dict | None = None) -> dict:
        folder = self.latest_tag(directory)
        root, tag = folder.parent, folder.name
        state = state if state is not None else load_checkpoint(folder / TRAINER_STATE)
        with weights_only_loading():
            if state["world_size"] == self.world_size and state["zero_stage"] == self.zero_stage:
                self.engine.load_checkpoint(str(root), tag=tag)
            else:
                logger.warning("checkpoint %s was written by %d process(es) with ZeRO-%d; this "
                               "run has %d with ZeRO-%d: resuming through DeepSpeed's universal "
                               "checkpoint", tag, state["world_size"], state["zero_stage"],
                               self.world_size, self.zero_stage)
                self.load_universal(root, tag)
        self.restore_rng(state["rng"])
        return state

    def load_universal(self, root: Path, tag: str) -> None:
        """Load ``tag`` into another layout: rank 0 converts it to DeepSpeed's universal
        format (every parameter's weights and optimizer state whole), every rank loads."""
        universal = root / f"{tag}{UNIVERSAL_SUFFIX}"
        if self.is_main and not universal.is_dir():
            # The converter's forked workers inherit its routed torch.load; the variable keeps
            # any worker started otherwise weights-only too (refusing, never unpickling).
            result = subprocess.run(
                [sys.executable, "-c", CONVERT_TO_UNIVERSAL, "--input_folder", str(root / tag),
                 "--output_folder", str(universal)],
                capture_output=True, text=True,
                env={**os.environ, "TORCH_FORCE_WEIGHTS_ONLY_LOAD": "1"})
            if result.returncode:
                shutil.rmtree(universal, ignore_errors=True)
                if result.returncode == 2:
                    raise ValueError(result.stderr.strip().splitlines()[-1])
                tail = "\n".join(result.stderr.strip().splitlines()[-5:])
                raise RuntimeError(f"converting {root / tag} to a universal checkpoint failed:\n"
                                   f"{tail}\nresume with the original number of processes "
                                   f"and ZeRO stage, or start from its weights with load_from: "
                                   f"{root / tag / DEEPSPEED_WEIGHTS}")
        self.barrier()
        # no public way: checkpoint.load_universal is read at initialize, before the layout is known
        self.engine._config.load_universal_checkpoint = True
        try:
            self.engine.load_checkpoint(str(root), tag=universal.name)
        finally:
            self.engine._config.load_universal_checkpoint = False
        self.load_non_parameter_state(root / tag)

    def load_non_parameter_state(self, folder: Path) -> None:
        """The module's state other than parameters (BatchNorm statistics, the running
        ``lam`` of ``lam: auto``) from ``folder``'s model states file: DeepSpeed's
        universal loader restores parameters only. Every rank's file holds all of it."""
        files = [f for f in sorted(folder.glob("*model_states.pt"))
                 if not f.name.startswith("layer_")]  # not a mixture-of-experts layer's file
        with weights_only_loading():
            module_state = torch.load(files[0], map_location="cpu", weights_only=True)["module"]
        parameters = {name for name, _ in self.module.named_parameters(remove_duplicate=False)}
        self.module.load_state_dict({key: value for key, value in module_state.items()
                                     if key not in parameters}, strict=False)
