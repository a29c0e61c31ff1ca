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
from mmgoal.objectives.mining import draw_one_per_row, scores_and_positives
from mmgoal.registry import OBJECTIVES
from mmgoal.structures import ObjectiveInputs, cat_features, check_inputs, index_features


@torch.no_grad()
def sample_hard_negatives(sims: torch.Tensor, positives: torch.Tensor, temperature: float,
                          generator: torch.Generator | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """One negative column per row, drawn from ``softmax(sims[row] / temperature)`` over the
    row's negatives.

    Returns:
        index (n_rows,) long; valid (n_rows,) bool, False for a row without negatives.
    """
    logits = (sims.float() / temperature).masked_fill(positives, float("-inf"))
    valid = (~positives).any(1)
    probs = torch.softmax(logits, dim=1).nan_to_num(0.0)
    probs[~valid] = 1.0  # anything: the row is masked out
    return draw_one_per_row(probs, generator), valid


@OBJECTIVES.register()
class ITMLoss(nn.Module):
    """Cross entropy of the ITM head on positives and softmax-sampled hard negatives.

    The training batch pairs image ``b`` with text ``b``; ``sims`` are the ITC
    scores of the batch. Needs the model (``match_logits``) and the features,
    which the trainer passes.

    With several processes, ``sims`` and the features are the gathered global
    batch, in rank order (rank ``r`` of ``W`` owns rows ``[r B, (r + 1) B)``).
    Negatives are drawn for every global row, as in one process, so this rank's
    draws are those that ``pairs: global`` makes for its rows; they may be any
    image or text of the global batch.

    Args:
        weight: the loss's factor in the total.
        temperature: of the sampling softmax (X-VLM samples from its ITC logits,
            ``S / 0.07`` at the start of training).
        pairs: ``local`` (the default) runs the fusion layers on this rank's own
            ``B`` positive pairs and their ``2 B`` negatives: the loss is this
            rank's, and data-parallel averaging trains on the mean of the ranks'
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

    def forward(self, inputs: ObjectiveInputs) -> dict[str, torch.Tensor]:
        check_inputs(inputs, "ITMLoss", "model", "image_features", "text_features")
        sims, positives = scores_and_positives(inputs)
        require(inputs.model, MatchingModel, "ITMLoss")
        model, generator = inputs.model, inputs.generator
        image_features, text_features = inputs.image_features, inputs.text_features
        if sims.shape[0] != sims.shape[1]:
            raise ValueError("ITMLoss needs the training batch's aligned pairs (n_images == "
                             "n_texts)")
        # Drawn for every row, whatever pairs are classified, so the draws do not
        # depend on the option (sampling on the scores is cheap; fusion is not).
        negative_text, text_ok = sample_hard_negatives(sims, positives, self.temperature,
                                                       generator)
        negative_image, image_ok = sample_hard_negatives(sims.T, positives.T, self.temperature,
                                                         generator)
        start, end = self.own_rows(inputs, len(sims))
        images, texts = image_features, text_features
        if (start, end) != (0, len(sims)):
            own = torch.arange(start, end, device=sims.device)
            images, texts = index_features(images, own), index_features(texts, own)
            negative_text, text_ok = negative_text[start:end], text_ok[start:end]
            negative_image, image_ok = negative_image[start:end], image_ok[start:end]
        batch = end - start
        images = cat_features([images, index_features(image_features, negative_image), images])
        texts = cat_features([texts, texts, index_features(text_features, negative_text)])
        labels = torch.cat([torch.ones(batch, dtype=torch.long, device=sims.device),
                            torch.zeros(2 * batch, dtype=torch.long, device=sims.device)])
        keep = torch.cat([torch.ones(batch, dtype=torch.bool, device=sims.device),
                          image_ok, text_ok])
        logits = model.match_logits(images, texts)
        loss = F.cross_entropy(logits[keep], labels[keep])
        accuracy = (logits[keep].argmax(1) == labels[keep]).float().mean()
        return {"itm_loss": self.weight * loss, "itm_accuracy": accuracy.detach()}


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
