"""WiSE-FT (Wortsman et al., "Robust fine-tuning of zero-shot models", CVPR 2022):
``(1 - alpha) * start + alpha * fine-tuned`` weights (docs/models.md, "WiSE-FT").
"""

from __future__ import annotations

import dataclasses

import torch

from mmgoal.models.lora import has_adapters, merge_adapters
from mmgoal.runs.loading import LoadedModel, load_pretrained_start


def check_alpha(alpha: float) -> float:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"a WiSE-FT alpha mixes the pretrained start (0) with the fine-tune "
                         f"(1): it lies in [0, 1], got {alpha}")
    return alpha


def interpolate_weights(start: dict[str, torch.Tensor], finetuned: dict[str, torch.Tensor],
                        alpha: float) -> dict[str, torch.Tensor]:
    """``(1 - alpha) * start + alpha * finetuned`` of every floating tensor; the others
    (step counters, token ids) are the fine-tune's. Refuses two different models."""
    check_alpha(alpha)
    if start.keys() != finetuned.keys():
        missing = sorted(set(start) ^ set(finetuned))[:5]
        raise ValueError(f"the fine-tune and its pretrained start hold different tensors "
                         f"({', '.join(missing)}, ...): not one model's weights")
    mixed = {}
    for name, tuned in finetuned.items():
        base = start[name]
        if base.shape != tuned.shape:
            raise ValueError(f"{name} is {tuple(tuned.shape)} in the fine-tune and "
                             f"{tuple(base.shape)} in its pretrained start")
        if tuned.is_floating_point():
            base = base.to(device=tuned.device, dtype=torch.float32)
            mixed[name] = torch.lerp(base, tuned.float(), alpha).to(tuned.dtype)
        else:
            mixed[name] = tuned
    return mixed


class WiseFT:
    """The models between a fine-tune (``loaded``) and its pretrained start, one at a time;
    LoRA adapters merged first (``merged``: the fine-tune's adapted layers). A
    ``ValueError`` for a run whose config names no pretrained weights."""

    def __init__(self, loaded: LoadedModel) -> None:
        self.start_model = load_pretrained_start(loaded)
        self.merged = 0
        if has_adapters(loaded.config):
            self.merged = merge_adapters(loaded.model)
            merge_adapters(self.start_model.model)
        self.finetuned = {k: v.detach().clone() for k, v in loaded.model.state_dict().items()}
        self.start = {k: v.detach().clone()
                      for k, v in self.start_model.model.state_dict().items()}

    def weights(self, alpha: float) -> dict[str, torch.Tensor]:
        """The state dict at ``alpha``."""
        return interpolate_weights(self.start, self.finetuned, alpha)

    def at(self, alpha: float) -> LoadedModel:
        """The model at ``alpha``: one model object, which a later call changes."""
        self.start_model.model.load_state_dict(self.weights(alpha))
        return dataclasses.replace(self.start_model, model=self.start_model.model.eval())
