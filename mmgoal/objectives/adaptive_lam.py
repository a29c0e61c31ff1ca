"""``lam: auto``: mmgoal's adaptive lambda for GOAL's sigmoid pair weights (not the
paper's). ``lam`` is the fixed point onto which ``sig``/``sig_ms`` gather the scores, so
it is put between them: a moving average, over the first ``lam_steps`` steps, of the
midpoint of each step's median positive and median hardest-negative score, then held.
A step's statistics are the union of every micro-batch on every rank, so every rank
computes the same ``lam``. Why, and what it does: docs/objectives.md, "An adaptive
lambda: lam: auto".
"""

from __future__ import annotations

import torch
from torch import nn

from mmgoal.distributed import gather


def step_midpoint(positive_scores: torch.Tensor, negative_scores: torch.Tensor) -> float:
    """``(median(positive_scores) + median(negative_scores)) / 2``, in the scores' dtype.

    ``torch.median`` takes the lower middle value: an element of the scores, independent
    of their order, and a multiset repeated ``W`` times (``W`` ranks that each hold the
    gathered global batch) has the median of one copy.
    """
    return float((positive_scores.median() + negative_scores.median()) / 2)


class AdaptiveLam(nn.Module):
    """The running ``lam`` of ``lam: auto`` (``value``, ``initial`` until the first update)
    and the statistics of the step under way: :meth:`observe` records one call's scores,
    :meth:`finish_step` updates ``lam`` (docs/objectives.md gives the formula) for at most
    ``steps`` updates, ``momentum`` in [0, 1).

    ``lam`` and ``updates`` are Python numbers, so DeepSpeed's bf16/fp16 cast of the module
    leaves them exact; the state dict holds them as float64 and int64 tensors, which every
    checkpoint format takes. ``paused`` (set by ``ObjectiveWarmup`` while a warm-up trains
    this objective with other attributes) drops what it sees, so ``lam`` measures the
    first ``steps`` steps after the warm-up.
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
