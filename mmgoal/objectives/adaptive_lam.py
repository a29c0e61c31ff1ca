"""``lam: auto``: mmgoal's adaptive lambda for GOAL's sigmoid pair weights.

Neither the GOAL paper nor its released code has it. ``sig`` and ``sig_ms`` pull
a positive up while its score is below ``lam`` and push a hard negative down
while its score is above it, so ``lam`` is the fixed point onto which the scores
of positives and their hardest negatives gather; a fixed ``lam`` helps only where
it sits between them (docs/results/goal_sweep_synthetic.md). ``lam: auto`` puts
it there: an exponential moving average, over the first ``lam_steps``
optimisation steps, of the midpoint between the median positive score and the
median hardest-negative score of each step; then it holds (docs/objectives.md,
"An adaptive lambda: lam: auto"). Held, ``lam`` keeps the fixed point that
holds the scores in place; followed for the whole run (``lam_steps: null``) it
moves with them, and positives and hardest negatives drift down together
without bound (docs/results/goal_fidelity.md).

The statistics of a step are those of every score matrix the objective saw in
it: every micro-batch of the accumulation window, on every rank, all-gathered
when the step ends. The update therefore depends only on the union of the
step's statistics, not on their order or on the rank that computed them, and
every rank computes the same ``lam``.
"""

from __future__ import annotations

import torch
from torch import nn

from mmgoal.distributed import gather_varying_length


def step_midpoint(positive_scores: torch.Tensor, negative_scores: torch.Tensor) -> float:
    """``(median(positive_scores) + median(negative_scores)) / 2``, in the scores' dtype.

    The median is ``torch.median``'s: the lower of the two middle values for an
    even count. So it is an element of the scores, independent of their order,
    and a multiset repeated ``W`` times has the median of one copy (``W`` ranks
    that each hold the gathered global batch report it ``W`` times).

    Args:
        positive_scores: (n_pos,) the score of every positive pair.
        negative_scores: (n_neg,) the hardest-negative score of every triplet.
    """
    return float((positive_scores.median() + negative_scores.median()) / 2)


class AdaptiveLam(nn.Module):
    """The running ``lam`` of ``lam: auto`` and the statistics of the step under way.

    ``value`` is the ``lam`` the pair weight uses. :meth:`observe` records the
    scores of one score matrix (one call of the objective); :meth:`finish_step`
    ends the optimisation step. When the step was applied, the statistics of all
    its calls on every rank give its midpoint ``c_t`` (:func:`step_midpoint`),
    and ``lam <- c_t`` at the first update, ``lam <- momentum * lam + (1 -
    momentum) * c_t`` at every later one, up to ``steps`` updates, after which
    ``lam`` holds; a skipped step (non-finite loss or gradient) changes nothing.
    Before the first update ``lam`` is ``initial``.

    ``lam`` and the number of updates are Python numbers, so casting the module
    (DeepSpeed's bf16/fp16 engines cast every floating buffer) leaves them exact,
    and its state dict holds them as tensors, ``lam`` (float64) and ``updates``
    (int64), which every checkpoint format takes (DeepSpeed's universal converter
    refuses anything else): a resumed run continues exactly. Checkpoints are
    written between steps, when no statistics are pending.

    ``paused`` (set by ``ObjectiveWarmup`` while its warm-up holds) drops what the
    objective sees: a warm-up that trains this objective with other attributes does not
    measure ``lam``, which then measures the first ``steps`` steps after it. (A warm-up
    that swaps in another objective never calls this one; a ``load_from`` loads model
    weights alone, so a fine-tune's ``lam`` measures its own first steps too.)

    Args:
        momentum: the weight of the running ``lam`` at each update, in [0, 1).
        initial: ``lam`` until the first update.
        steps: the number of updates, after which ``lam`` holds; ``None``: no limit.
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
        """Record one score matrix's statistics for the step under way.

        Args:
            positive_scores: (n_pos,) the score of every positive pair.
            negative_scores: (n_neg,) the hardest-negative score of every valid triplet.
        """
        if self.holding or self.paused:
            return
        self._positives.append(positive_scores.detach().flatten())
        self._negatives.append(negative_scores.detach().flatten())

    @torch.no_grad()
    def finish_step(self, applied: bool) -> None:
        """End the optimisation step; update ``lam`` when it was applied.

        Collective with several processes: every rank calls it after every step
        (the strategies do), and the ranks' statistics are all-gathered.
        """
        positives, negatives = self._positives, self._negatives
        self._positives, self._negatives = [], []
        # Every rank called the objective as often and holds alike, so every rank
        # returns here alike.
        if not applied or not positives:
            return
        positives = gather_varying_length(torch.cat(positives))
        negatives = gather_varying_length(torch.cat(negatives))
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
