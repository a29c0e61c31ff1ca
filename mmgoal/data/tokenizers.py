"""Tokenizers: captions -> padded token ids.

Every tokenizer maps a list of captions to ``{"tokens": (B, L) long,
"lengths": (B,) long, "attention_mask": (B, L) bool}`` and can save and restore
its state (a plain dict, safe for ``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence

import torch

from mmgoal.registry import TOKENIZERS

_WORD = re.compile(r"[a-z0-9]+")


def pad_token_ids(ids: Sequence[Sequence[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Pad variable-length id lists into a batch.

    Returns:
        tokens: (B, L) long, lengths: (B,) long, attention_mask: (B, L) bool.
    """
    lengths = torch.tensor([len(x) for x in ids], dtype=torch.long)
    width = int(lengths.max()) if len(ids) else 0
    tokens = torch.full((len(ids), width), pad_id, dtype=torch.long)
    for row, seq in enumerate(ids):
        tokens[row, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    return {"tokens": tokens, "lengths": lengths, "attention_mask": mask}


@TOKENIZERS.register()
class WordTokenizer:
    """Lower-cased word tokenizer with a vocabulary built from training captions.

    Args:
        vocab: the word list (index = id after the special tokens); ``None``
            means "fit on the training captions" (the trainer does it and saves
            the vocabulary with the checkpoint).
        min_count: words seen fewer times in training become ``<unk>``.
        max_length: longer captions are cut.
    """

    PAD, UNK = "<pad>", "<unk>"

    def __init__(self, vocab: list[str] | None = None, min_count: int = 1,
                 max_length: int = 40) -> None:
        self.min_count = min_count
        self.max_length = max_length
        self.words: list[str] = []
        self.index: dict[str, int] = {}
        if vocab is not None:
            self._set_words(vocab)

    def _set_words(self, words: Iterable[str]) -> None:
        self.words = [self.PAD, self.UNK] + [w for w in words if w not in (self.PAD, self.UNK)]
        self.index = {w: i for i, w in enumerate(self.words)}

    @property
    def fitted(self) -> bool:
        return bool(self.words)

    @property
    def vocab_size(self) -> int:
        return len(self.words)

    @property
    def pad_id(self) -> int:
        return 0

    def __len__(self) -> int:
        return len(self.words)

    @staticmethod
    def split(caption: str) -> list[str]:
        return _WORD.findall(caption.lower())

    def fit(self, captions: Iterable[str]) -> WordTokenizer:
        """Build the vocabulary: words seen ``min_count`` times, most frequent first."""
        counts = Counter(w for c in captions for w in self.split(c))
        kept = sorted((w for w, n in counts.items() if n >= self.min_count),
                      key=lambda w: (-counts[w], w))
        if not kept:
            raise ValueError("cannot build a vocabulary: the training captions hold no words")
        self._set_words(kept)
        return self

    def encode(self, caption: str) -> list[int]:
        unk = self.index[self.UNK]
        ids = [self.index.get(w, unk) for w in self.split(caption)[: self.max_length]]
        return ids or [unk]  # an empty caption still has one token to encode

    def __call__(self, captions: Sequence[str]) -> dict[str, torch.Tensor]:
        if not self.fitted:
            raise RuntimeError("WordTokenizer has no vocabulary: call fit() or pass vocab=")
        return pad_token_ids([self.encode(c) for c in captions], self.pad_id)

    def state_dict(self) -> dict:
        return {"words": list(self.words)}

    def load_state_dict(self, state: dict) -> None:
        self._set_words(state["words"])


@TOKENIZERS.register()
class HFTokenizer:
    """A Hugging Face tokenizer loaded from a local folder (never from the hub).

    Args:
        path: folder holding the tokenizer files (e.g. a model's folder).
        max_length: longer captions are cut.
    """

    def __init__(self, path: str, max_length: int = 40) -> None:
        from transformers import AutoTokenizer

        self.path = path
        self.max_length = max_length
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)

    fitted = True

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def pad_id(self) -> int:
        return int(self.tokenizer.pad_token_id or 0)

    def __len__(self) -> int:
        return self.vocab_size

    def fit(self, captions: Iterable[str]) -> HFTokenizer:
        return self

    def __call__(self, captions: Sequence[str]) -> dict[str, torch.Tensor]:
        out = self.tokenizer(list(captions), padding=True, truncation=True,
                             max_length=self.max_length, return_tensors="pt")
        mask = out["attention_mask"].bool()
        return {"tokens": out["input_ids"], "lengths": mask.sum(1), "attention_mask": mask}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
