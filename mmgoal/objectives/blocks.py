"""Objectives whose terms are per anchor row, computed a block of rows at a time.

An objective such as InfoNCE or SigLIP sums a term per anchor (an image's row of the
score matrix, a text's column); each term reads only its own row. :func:`in_row_blocks`
computes the sum and its gradient block by block, forward and backward, so that no
tensor of the matrix's shape is alive beside the scores and their one gradient
(docs/reference/objectives.md, "In blocks"): the autograd formula holds a scaled copy, a
log-softmax or sigmoid and their gradients, each ``(n, n)``, and one gradient per
direction before they are added. A :class:`RowTerm` says what a block's terms are and
their derivative; the backward pass recomputes what it needs from the scores.
"""

from __future__ import annotations

import torch

from mmgoal.structures import ScoreShare

# Rows of the score matrix a block holds (each temporary of a block: rows x n values)
BLOCK_ROWS = 1024


class RowTerm:
    """The terms of a block of anchor rows: subclasses give :meth:`loss`, and :meth:`grad`
    where a closed form beats autograd on the recomputed block (the default).

    ``direction`` is ``"i2t"`` (image anchors, a block of rows) or ``"t2i"`` (text
    anchors, a block of columns, transposed); ``scores`` (rows, n_others) and
    ``positives`` (same shape, bool) are the block's; ``params`` the scalar tensors the
    terms depend on (a temperature, a bias), in the order :func:`in_row_blocks` got them.
    ``directions`` lists the directions the objective has terms in.
    """

    directions: tuple[str, ...] = ("i2t", "t2i")

    def loss(self, direction: str, scores: torch.Tensor, positives: torch.Tensor,
             *params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(sum of the block's terms, per-row values kept for grad or None)``."""
        raise NotImplementedError

    def grad(self, direction: str, scores: torch.Tensor, positives: torch.Tensor,
             kept: torch.Tensor | None, *params: torch.Tensor
             ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """``(d sum / d scores, (d sum / d param, ...))`` of the block: by default, autograd
        through :meth:`loss` on the block again."""
        with torch.enable_grad():
            leaves = [scores.detach().requires_grad_(),
                      *(p.detach().requires_grad_() for p in params)]
            value, _ = self.loss(direction, leaves[0], positives, *leaves[1:])
            grads = torch.autograd.grad(value, leaves, allow_unused=True)
        grads = [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads)]
        return grads[0], tuple(grads[1:])


def check_block_rows(block_rows: int) -> int:
    """``block_rows`` of an objective's config, checked where it is built."""
    if block_rows < 1:
        raise ValueError(f"block_rows must be at least 1, got {block_rows}")
    return block_rows


def _blocks(term: RowTerm, rows: torch.Tensor, columns: torch.Tensor,
            row_positives: torch.Tensor, column_positives: torch.Tensor, block: int):
    """``(direction, index of the block's anchors, scores, positives)`` of every block."""
    for direction in term.directions:
        if direction == "i2t":
            for start in range(0, rows.shape[0], block):
                index = slice(start, start + block)
                yield direction, index, rows[index], row_positives[index]
        else:
            for start in range(0, columns.shape[1], block):
                index = slice(start, start + block)
                yield direction, index, columns[:, index].T, column_positives[:, index].T


class _InRowBlocks(torch.autograd.Function):
    """The sum of a :class:`RowTerm` over every block; ``columns`` None: they are ``rows``
    (one process's whole matrix), whose one gradient then gets both directions'."""

    @staticmethod
    def forward(ctx, term: RowTerm, block: int, rows: torch.Tensor,
                columns: torch.Tensor | None, row_positives: torch.Tensor,
                column_positives: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        kept, total = [], rows.new_zeros(())
        for direction, _, scores, positives in _blocks(
                term, rows, rows if columns is None else columns, row_positives,
                column_positives, block):
            value, values = term.loss(direction, scores, positives, *params)
            total += value
            kept.append(values)
        ctx.term, ctx.block, ctx.kept, ctx.same = term, block, kept, columns is None
        ctx.save_for_backward(rows, rows if columns is None else columns, row_positives,
                              column_positives, *params)
        return total

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        rows, columns, row_positives, column_positives, *params = ctx.saved_tensors
        grad_rows = torch.zeros_like(rows) if ctx.needs_input_grad[2] else None
        grad_columns = (None if ctx.same or not ctx.needs_input_grad[3]
                        else torch.zeros_like(columns))
        grad_params = [torch.zeros_like(p) for p in params]
        for (direction, index, scores, positives), kept in zip(
                _blocks(ctx.term, rows, columns, row_positives, column_positives, ctx.block),
                ctx.kept):
            d_scores, d_params = ctx.term.grad(direction, scores, positives, kept, *params)
            for total, d in zip(grad_params, d_params):
                total += d * grad_output
            target = grad_rows if direction == "i2t" or ctx.same else grad_columns
            if target is None:
                continue
            d_scores = d_scores.mul_(grad_output)
            if direction == "i2t":
                target[index] += d_scores
            else:
                target[:, index] += d_scores.T
        return (None, None, grad_rows, grad_columns, None, None, *grad_params)


def in_row_blocks(term: RowTerm, share: ScoreShare, *params: torch.Tensor,
                  block: int = BLOCK_ROWS) -> torch.Tensor:
    """The sum of ``term`` over the anchors of ``share``, ``block`` anchors at a time,
    with the gradient for the share's rows, its columns and ``params``."""
    check_block_rows(block)
    if "t2i" in term.directions:
        columns = None if share.one_matrix else share.columns
        column_positives = share.column_positives
    else:  # never fetch the columns of an objective on the image rows alone
        columns, column_positives = None, share.row_positives
    return _InRowBlocks.apply(term, block, share.rows, columns, share.row_positives,
                              column_positives, *params)


class _Take(torch.autograd.Function):
    """``torch.take`` whose backward adds into one zeroed gradient (torch's own makes the
    zeroed tensor, then a written copy of it)."""

    @staticmethod
    def forward(ctx, base: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.shape = base.shape
        return torch.take(base, index)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (index,) = ctx.saved_tensors
        grad = grad_output.new_zeros(ctx.shape)
        grad.view(-1).index_add_(0, index, grad_output)
        return grad, None


def take_scores(share: ScoreShare, wanted: dict[str, list[tuple[torch.Tensor, torch.Tensor]]]
                ) -> dict[str, list[torch.Tensor]]:
    """Scores of pairs of a share, with their gradient, by one read of each tensor.

    Args:
        share: the scores.
        wanted: ``{direction: [(anchors, others), ...]}``, each pair of index tensors in the
            coordinates of :meth:`~mmgoal.structures.ScoreShare.directions`' block of that
            direction (``t2i``: text ``anchors[k]``, image ``others[k]``).

    Returns:
        ``{direction: [scores, ...]}``, one tensor of the pairs' scores per pair of indices.

    Each tensor the pairs come from is read once (``torch.take``), and the backward adds
    into one gradient of the tensor's shape: indexing it once per pair of indices, as the
    autograd formula does, gives one dense gradient per read, and their sum.
    """
    reads: dict[int, tuple[torch.Tensor, list]] = {}
    for direction, pairs in wanted.items():
        base = share.rows if direction == "i2t" else share.columns
        for k, (anchors, others) in enumerate(pairs):
            index = (anchors * base.shape[1] + others if direction == "i2t"
                     else others * base.shape[1] + anchors)
            reads.setdefault(id(base), (base, []))[1].append((direction, k, index))
    taken: dict[str, list] = {direction: [None] * len(pairs) for direction, pairs in wanted.items()}
    for base, parts in reads.values():
        values = _Take.apply(base, torch.cat([index for _, _, index in parts]))
        for (direction, k, _), part in zip(parts, values.split([len(i) for _, _, i in parts])):
            taken[direction][k] = part
    return taken
