"""Image-text matching (ITM) with hard negatives sampled from the ITC scores (X-VLM, ALBEF).

For every text one negative image, and for every image one negative text, is
drawn with probabilities ``softmax(S / temperature)`` over the batch, entries of
the same image set to zero; the fusion layers then classify the positive pairs
and the negatives (cross entropy on the 2-way ITM head).

With several processes and gathered features, each rank runs the fusion layers on
its own pairs only (its rows of the global batch and their negatives, which may be
any image or text of the global batch), as X-VLM and ALBEF do; ``pairs: global``
runs them on every pair of the global batch on every rank (redundant, the same
update in expectation).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmgoal.contract import MatchingModel, StepAwareObjective, require
from mmgoal.distributed import world_info
from mmgoal.objectives.mining import row_uniforms, score_share
from mmgoal.registry import OBJECTIVES
from mmgoal.structures import ObjectiveInputs, cat_features, check_inputs, index_features


@torch.no_grad()
def sample_hard_negatives(sims: torch.Tensor, positives: torch.Tensor, temperature: float,
                          generator: torch.Generator | None = None,
                          uniforms: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """One negative column per row, drawn from ``softmax(sims[row] / temperature)`` over the
    row's negatives, by inverting the row's cumulative distribution at a uniform draw.

    Args:
        uniforms: (n_rows,) the draws in [0, 1), so that a row's negative depends on its own
            scores and draw alone (each rank draws its rows of the global batch as one
            process would); ``None``: drawn here (:func:`row_uniforms`).

    Returns:
        index (n_rows,) long; valid (n_rows,) bool, False for a row without negatives.
    """
    logits = (sims.float() / temperature).masked_fill(positives, float("-inf"))
    valid = (~positives).any(1)
    probs = torch.softmax(logits, dim=1).nan_to_num(0.0)
    probs[~valid] = 1.0  # anything: the row is masked out
    if uniforms is None:
        uniforms = row_uniforms(len(probs), probs.device, generator)
    cdf = probs.cumsum(1)
    # the first column whose cumulative probability passes the draw: never one of weight 0
    target = (uniforms.to(cdf.dtype) * cdf[:, -1])[:, None]
    index = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return index.clamp(max=sims.shape[1] - 1), valid


@OBJECTIVES.register()
class ITMLoss(nn.Module):
    """Cross entropy of the ITM head on positives and softmax-sampled hard negatives.

    The training batch pairs image ``b`` with text ``b``; ``sims`` are the ITC
    scores of the batch. Needs the model (``match_logits``) and the features,
    which the trainer passes.

    With several processes the features are the gathered global batch, in rank order
    (rank ``r`` of ``W`` owns pairs ``[r B, (r + 1) B)``), and a uniform draw is made for
    every pair of it, so a pair's negatives depend on its scores and its draw alone
    (:func:`sample_hard_negatives`): as one process draws them. Under local scoring (it
    works on rows) a rank draws its images' negative texts from its rows and its texts'
    negative images from its columns, classifies its ``3 B`` pairs, and returns its part
    of the mean over the global batch's pairs (the count summed over the ranks), so the
    logged loss and the gradient are one process's. Under replicated scoring the whole
    matrix is on every rank and ``pairs`` chooses (below). The negatives may be any image
    or text of the global batch.

    Args:
        weight: the loss's factor in the total.
        temperature: of the sampling softmax (X-VLM samples from its ITC logits,
            ``S / 0.07`` at the start of training).
        pairs: under replicated scoring, ``local`` (the default) runs the fusion layers
            on this rank's own ``B`` positive pairs and their ``2 B`` negatives: the loss
            is this rank's, and data-parallel averaging trains on the mean of the ranks'
            losses (the ``pairs: global`` loss when every row has negatives;
            ``mmgoal/distributed.py``). ``global`` runs them on all ``3 W B``
            pairs of the global batch on every rank (each rank repeats the same
            fusion work). The same in one process, or with features not gathered.
    """

    PAIRS = ("local", "global")

    def __init__(self, weight: float = 1.0, temperature: float = 0.07,
                 pairs: str = "local") -> None:
        super().__init__()
        if pairs not in self.PAIRS:
            raise ValueError(f"ITMLoss pairs must be one of {', '.join(self.PAIRS)}, "
                             f"got {pairs!r}")
        self.weight = weight
        self.temperature = temperature
        self.pairs = pairs

    def own_rows(self, inputs: ObjectiveInputs, rows: int) -> tuple[int, int]:
        """The rows ``[start, end)`` of ``sims`` whose pairs this rank classifies."""
        rank, world = world_info()
        local = inputs.local_image_features
        if self.pairs == "global" or world == 1 or local is None:
            return 0, rows
        size = len(local.embedding)
        if size == rows:  # features not gathered: the rows are this rank's
            return 0, rows
        if size * world != rows:
            raise ValueError(f"ITMLoss: {rows} rows of scores are neither this rank's {size} "
                             f"pairs nor the {world} ranks' gathered {size * world}")
        return rank * size, (rank + 1) * size

    works_on_rows = True  # a rank classifies its own pairs, drawn from its rows (ScoreShare)

    def forward(self, inputs: ObjectiveInputs) -> dict[str, torch.Tensor]:
        check_inputs(inputs, "ITMLoss", "model", "image_features", "text_features")
        share = score_share(inputs)
        require(inputs.model, MatchingModel, "ITMLoss")
        model, generator = inputs.model, inputs.generator
        image_features, text_features = inputs.image_features, inputs.text_features
        n = share.n_images
        if share.n_texts != n:
            raise ValueError("ITMLoss needs the training batch's aligned pairs (n_images == "
                             "n_texts)")
        device = share.rows.device
        # Drawn for every pair of the batch, whatever pairs are classified, so the draws do
        # not depend on the option or the rank (sampling is cheap; fusion is not).
        text_draws, image_draws = (row_uniforms(n, device, generator) for _ in range(2))
        if inputs.share is not None:  # local scoring: the rank's rows, a part of the mean
            start, end = share.offset, share.offset + len(share.rows)
            rows, columns = share.rows, share.columns
            row_positives, column_positives = share.row_positives, share.column_positives
        else:  # the whole matrix: this rank's pairs of it, or every pair (pairs: global)
            start, end = self.own_rows(inputs, n)
            rows, columns = share.rows[start:end], share.rows[:, start:end]
            row_positives = share.row_positives[start:end]
            column_positives = share.row_positives[:, start:end]
        negative_text, text_ok = sample_hard_negatives(rows, row_positives, self.temperature,
                                                       uniforms=text_draws[start:end])
        negative_image, image_ok = sample_hard_negatives(
            columns.T, column_positives.T, self.temperature, uniforms=image_draws[start:end])
        own = torch.arange(start, end, device=device)
        images, texts = index_features(image_features, own), index_features(text_features, own)
        batch = end - start
        images = cat_features([images, index_features(image_features, negative_image), images])
        texts = cat_features([texts, texts, index_features(text_features, negative_text)])
        labels = torch.cat([torch.ones(batch, dtype=torch.long, device=device),
                            torch.zeros(2 * batch, dtype=torch.long, device=device)])
        keep = torch.cat([torch.ones(batch, dtype=torch.bool, device=device),
                          image_ok, text_ok])
        logits = model.match_logits(images, texts)
        losses = F.cross_entropy(logits[keep], labels[keep], reduction="none")
        correct = (logits[keep].argmax(1) == labels[keep]).to(losses.dtype)
        # the mean over the kept pairs of the whole batch: counted over the shares
        kept = share.total(keep.sum().to(losses.dtype)).clamp(min=1)
        return {"itm_loss": self.weight * losses.sum() / kept,
                "itm_accuracy": share.total(correct.sum().detach()) / kept}


@OBJECTIVES.register()
class ObjectiveSum(nn.Module):
    """Several objectives on the same scores, their losses added (X-VLM: ITC + ITM).

    Args:
        terms: ``OBJECTIVES`` configs. Swap one term for another with an
            override, e.g. ``objective.terms.0={type: GoalObjective, ...}`` puts
            a GOAL objective in place of the ITC term while ITM stays.
        tokenizer: handed to the terms that take one (MLM, box grounding; set by the trainer).
        model: the model trained, handed to the terms that take it (set by the trainer).
    """

    def __init__(self, terms: list[dict], tokenizer=None, model: nn.Module | None = None
                 ) -> None:
        super().__init__()
        if not terms:
            raise ValueError("ObjectiveSum needs at least one term")
        self.terms = nn.ModuleList(OBJECTIVES.build(term, tokenizer=tokenizer, model=model)
                                   for term in terms)

    @property
    def works_on_rows(self) -> bool:
        """A sum works on rows (local scoring) when every term does."""
        return all(getattr(term, "works_on_rows", False) for term in self.terms)

    def forward(self, inputs: ObjectiveInputs) -> dict[str, torch.Tensor]:
        outputs: dict[str, torch.Tensor] = {}
        for term in self.terms:
            for key, value in term(inputs).items():
                if key in outputs:
                    raise ValueError(f"two ObjectiveSum terms both return {key!r}")
                outputs[key] = value
        return outputs

    def finish_step(self, applied: bool) -> None:
        """Pass the end of a step on to the terms that keep state across it (GOAL's
        ``lam: auto``), so they behave inside a sum as they do alone."""
        for term in self.terms:
            if isinstance(term, StepAwareObjective):
                term.finish_step(applied)
