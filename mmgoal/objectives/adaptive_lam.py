"""``lam: auto``: mmgoal's adaptive lambda for GOAL's sigmoid pair weights (not the
paper's): a moving average, over the first ``lam_steps`` steps, of the midpoint of each
step's median positive and hardest-negative score, the same on every rank. Why:
docs/objectives.md, "An adaptive lambda: lam: auto".
"""

from __future__ import annotations

import torch
from torch import nn

from mmgoal.distributed import gather


def step_midpoint(positive_scores: torch.Tensor, negative_scores: torch.Tensor) -> float:
    """``(median(positive_scores) + median(negative_scores)) / 2``, in the scores' dtype;
    ``torch.median``'s lower middle value is the same for the batch repeated on ``W`` ranks.
    """
    return float((positive_scores.median() + negative_scores.median()) / 2)


class AdaptiveLam(nn.Module):
    """The running ``lam`` of ``lam: auto`` (``value``, ``initial`` until the first update):
    :meth:`observe` records one call's scores, :meth:`finish_step` updates ``lam`` for at
    most ``steps`` updates, ``momentum`` in [0, 1). Python numbers, so a bf16/fp16 cast
    leaves them exact (float64/int64 in the state dict); ``paused`` (``ObjectiveWarmup``)
    drops what it sees, so ``lam`` measures the first ``steps`` steps after the warm-up.
    """

    def __init__(self, momentum: float, initial: float, steps: int | None = None) -> None:
        super().__init__()
        self.momentum = float(momentum)
        self.initial = float(initial)
        self.steps = steps
        self.value = float(initial)
        self.updates = 0
        self.paused = False
        self._positives: list[torch.Tensor] = []
        self._negatives: list[torch.Tensor] = []

    def extra_repr(self) -> str:
        return (f"momentum={self.momentum}, initial={self.initial}, steps={self.steps}, "
                f"lam={self.value:.6g}, updates={self.updates}")

    @property
    def holding(self) -> bool:
        """``lam`` has had its ``steps`` updates and no longer moves."""
        return self.steps is not None and self.updates >= self.steps

    @torch.no_grad()
    def observe(self, positive_scores: torch.Tensor, negative_scores: torch.Tensor) -> None:
        """Record one call's scores of every positive pair and every valid triplet's
        hardest negative for the step under way."""
        if self.holding or self.paused:
            return
        self._positives.append(positive_scores.detach().flatten())
        self._negatives.append(negative_scores.detach().flatten())

    @torch.no_grad()
    def finish_step(self, applied: bool) -> None:
        """End the optimisation step; update ``lam`` when it was applied. Collective: every
        rank calls it after every step, and the ranks' statistics are all-gathered."""
        positives, negatives = self._positives, self._negatives
        self._positives, self._negatives = [], []
        # Every rank called the objective as often and holds alike, so every rank
        # returns here alike.
        if not applied or not positives:
            return
        positives = gather(torch.cat(positives), uneven=True)
        negatives = gather(torch.cat(negatives), uneven=True)
        if not len(positives) or not len(negatives):
            return
        target = step_midpoint(positives, negatives)
        self.value = (target if not self.updates
                      else self.momentum * self.value + (1 - self.momentum) * target)
        self.updates += 1

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        # Python numbers saved as CPU tensors, like every checkpointed state
        destination[prefix + "lam"] = torch.tensor(self.value, dtype=torch.float64,
                                                   device="cpu")
        destination[prefix + "updates"] = torch.tensor(self.updates, dtype=torch.int64,
                                                       device="cpu")

    def _load_from_state_dict(self, state_dict: dict, prefix: str, local_metadata: dict,
                              strict: bool, missing_keys: list, unexpected_keys: list,
                              error_msgs: list) -> None:
        missing = [prefix + name for name in ("lam", "updates") if prefix + name not in state_dict]
        missing_keys.extend(missing)
        if not missing:
            self.value = float(state_dict[prefix + "lam"])
            self.updates = int(state_dict[prefix + "updates"])
