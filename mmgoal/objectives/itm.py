"""Image-text matching (ITM) with hard negatives sampled from the ITC scores (X-VLM, ALBEF;
docs/reference/xvlm.md). The draws are made on score tiles, exactly, by the Gumbel-max
trick (:class:`~mmgoal.scoring.GumbelMax`).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from mmgoal.contract import MatchingModel, StepAwareObjective, require, works_on_tiles
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
    temperature)`` over the row's negatives as ITMLoss does on tiles: index (n_rows,) and
    valid (n_rows,), False for a row without negatives."""
    seed = draw_seed(generator) if seed is None else seed
    draws = GumbelMax(temperature, seed, sims.shape[1], sims.shape[0], cols=False)
    ScoreTiles(MatrixScorer(sims.detach()), *sims.shape, positives=positives.bool()
               ).statistics(draws)
    return draws.row_index, draws.row_valid


@OBJECTIVES.register()
class ITMLoss(nn.Module):
    """Cross entropy of the ITM head on the batch's pairs and softmax-sampled hard negatives
    from the global batch (``temperature``: of that softmax). Under replicated scoring
    ``pairs`` is ``local`` (this rank's, X-VLM's way) or ``global`` (all ``3 W B`` on every
    rank; docs/distributed.md, "Objectives on the global batch").
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
    ``terms``: ``OBJECTIVES`` configs, each swappable by an override
    (``objective.terms.0={type: GoalObjective, ...}``); the trainer's ``tokenizer`` and
    ``model`` are handed to the terms that take them."""

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
        return all(map(works_on_tiles, self.terms))

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
