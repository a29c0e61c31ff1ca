"""Image-text matching (ITM) with hard negatives sampled from the ITC scores (X-VLM, ALBEF).

For every text one negative image, and for every image one negative text, is
drawn with probabilities ``softmax(S / temperature)`` over the batch, entries of
the same image set to zero; the fusion layers then classify the positive pairs
and the negatives (cross entropy on the 2-way ITM head). The draws are made on score
tiles, exactly, by the Gumbel-max trick (:class:`~mmgoal.scoring.GumbelMax`: a running
argmax of ``S / temperature`` plus noise fixed by each entry's position and a seed).

With several processes and gathered features, each rank runs the fusion layers on
its own pairs only (its rows of the global batch and their negatives, which may be
any image or text of the global batch), as X-VLM and ALBEF do; ``pairs: global``
runs them on every pair of the global batch on every rank (redundant, the same
update in expectation).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from mmgoal.contract import MatchingModel, StepAwareObjective, require
from mmgoal.distributed import world_info
from mmgoal.objectives.mining import score_tiles
from mmgoal.registry import OBJECTIVES
from mmgoal.scoring import GumbelMax, MatrixScorer, ScoreTiles
from mmgoal.structures import ObjectiveInputs, cat_features, check_inputs, index_features


def draw_seed(generator: torch.Generator | None) -> int:
    """A seed for :class:`~mmgoal.scoring.GumbelMax`'s noise, drawn from ``generator`` (or
    torch's own random state)."""
    device = generator.device if generator is not None else "cpu"
    return int(torch.randint(0, 1 << 62, (1,), generator=generator, device=device))


@torch.no_grad()
def sample_hard_negatives(sims: torch.Tensor, positives: torch.Tensor, temperature: float,
                          generator: torch.Generator | None = None,
                          seed: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One negative column per row of a score matrix, drawn from ``softmax(sims[row] /
    temperature)`` over the row's negatives (the Gumbel-max draw ITMLoss makes on tiles;
    ``seed``: its noise, else drawn from ``generator``).

    Returns:
        index (n_rows,) long; valid (n_rows,) bool, False for a row without negatives.
    """
    seed = draw_seed(generator) if seed is None else seed
    draws = GumbelMax(temperature, seed, sims.shape[1], sims.shape[0], cols=False)
    ScoreTiles(MatrixScorer(sims.detach()), *sims.shape, positives=positives.bool()
               ).statistics(draws)
    return draws.row_index, draws.row_valid


@OBJECTIVES.register()
class ITMLoss(nn.Module):
    """Cross entropy of the ITM head on positives and softmax-sampled hard negatives.

    The training batch pairs image ``b`` with text ``b``; ``sims`` are the ITC
    scores of the batch. Needs the model (``match_logits``) and the features,
    which the trainer passes.

    The negatives are drawn on the score tiles by the Gumbel-max trick (one pass, the
    matrix never built): a row's negative is the argmax of ``S / temperature + g`` over
    its negatives, ``g`` Gumbel noise fixed by the entry's position and a seed drawn once
    a step (:class:`~mmgoal.scoring.GumbelMax`), an exact draw from the row's softmax.
    With several processes the features are the gathered global batch, in rank order
    (rank ``r`` of ``W`` owns pairs ``[r B, (r + 1) B)``). Under local scoring a rank
    draws its images' negative texts from its rows and its texts' negative images from
    their columns (reduced over the ranks), classifies its ``3 B`` pairs, and returns its
    part of the mean over the global batch's pairs (the count summed over the ranks), so
    the logged loss and the gradient are one process's in distribution. Under replicated
    scoring every rank streams every tile and ``pairs`` chooses (below). The negatives may
    be any image or text of the global batch.

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

    def __init__(self, weight: float = 1.0, temperature: float = 0.07,
                 pairs: Literal["local", "global"] = "local") -> None:
        super().__init__()
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

    works_on_tiles = True  # a rank classifies its own pairs, drawn from its tiles

    def forward(self, inputs: ObjectiveInputs) -> dict[str, torch.Tensor]:
        check_inputs(inputs, "ITMLoss", "model", "image_features", "text_features")
        tiles = score_tiles(inputs)
        require(inputs.model, MatchingModel, "ITMLoss")
        model, generator = inputs.model, inputs.generator
        image_features, text_features = inputs.image_features, inputs.text_features
        n = tiles.n_images
        if tiles.n_texts != n:
            raise ValueError("ITMLoss needs the training batch's aligned pairs (n_images == "
                             "n_texts)")
        device = tiles.device
        # a rank's images draw their negative texts from its rows, its texts their negative
        # images from their columns (reduced over the ranks): every draw is one process's
        draws = GumbelMax(self.temperature, draw_seed(generator), n, n)
        tiles.statistics(draws)
        start, end = ((tiles.rows.start, tiles.rows.stop) if tiles.sharded
                      else self.own_rows(inputs, n))
        local = slice(start - tiles.rows.start, end - tiles.rows.start)
        negative_text, text_ok = draws.row_index[local], draws.row_valid[local]
        negative_image, image_ok = draws.col_index[start:end], draws.col_valid[start:end]
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
        # the mean over the kept pairs of the whole batch: counted over the ranks' shares
        kept = tiles.total(keep.sum().to(losses.dtype)).clamp(min=1)
        return {"itm_loss": self.weight * losses.sum() / kept,
                "itm_accuracy": tiles.total(correct.sum().detach()) / kept}


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
    def works_on_tiles(self) -> bool:
        """A sum works on score tiles (local scoring) when every term does."""
        return all(getattr(term, "works_on_tiles", False) for term in self.terms)

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
