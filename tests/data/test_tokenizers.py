import pytest
import torch

from mmgoal.data.tokenizers import TokenAugment, WordTokenizer


class SpecialTokens:
    """A tokenizer with [CLS] = 1 and [SEP] = 2 around the words, like BERT's."""

    pad_id, mask_id, special_ids = 0, 3, [0, 1, 2, 3]

    def __len__(self):
        return 100


def bert_like_batch(rows=200, words=20):
    torch.manual_seed(0)
    tokens = torch.stack([10 + torch.randperm(90)[:words + 2] for _ in range(rows)])
    tokens[:, 0], tokens[:, -1] = 1, 2
    return tokens, torch.full((rows,), words + 2)


def test_token_augment_changes_the_documented_shares_and_never_special_tokens():
    tokens, lengths = bert_like_batch()
    out = TokenAugment(SpecialTokens(), p=0.2)(tokens, lengths,
                                               generator=torch.Generator().manual_seed(0))
    words = 200 * 20
    deleted = int((lengths - out["lengths"]).sum())
    masked = int((out["tokens"] == 3).sum())
    assert out["tokens"][:, 0].eq(1).all()
    assert out["tokens"][torch.arange(200), out["lengths"] - 1].eq(2).all()
    # 0.2 x (50% mask, 10% replace, 40% delete) of 4000 words, within 4 standard deviations
    assert abs(masked - 0.1 * words) < 4 * (0.1 * 0.9 * words) ** 0.5
    assert abs(deleted - 0.08 * words) < 4 * (0.08 * 0.92 * words) ** 0.5
    assert out["attention_mask"].sum(1).tolist() == out["lengths"].tolist()
    no_replace = TokenAugment(SpecialTokens(), p=0.5, replace=0.0)(tokens, lengths)
    for row in range(20):  # survivors keep their order: the unmasked ones are a subsequence
        kept = [t for t in no_replace["tokens"][row, :no_replace["lengths"][row]].tolist()
                if t != 3]
        positions = [tokens[row].tolist().index(t) for t in kept]
        assert positions == sorted(positions)


def test_token_augment_edge_cases():
    tokenizer = WordTokenizer(vocab=["a", "red", "circle"])
    batch = tokenizer(["a red circle", "red"])
    same = TokenAugment(tokenizer, p=0.0)(batch["tokens"], batch["lengths"])
    assert torch.equal(same["tokens"], batch["tokens"])
    masked = TokenAugment(tokenizer, p=1.0, mask=1.0, replace=0.0)(batch["tokens"],
                                                                  batch["lengths"])
    assert masked["tokens"].tolist() == [[1, 1, 1], [1, 0, 0]]  # <unk>, then padding
    emptied = TokenAugment(tokenizer, p=1.0, mask=0.0, replace=0.0)(batch["tokens"],
                                                                   batch["lengths"])
    assert torch.equal(emptied["tokens"], batch["tokens"])  # never an empty caption
    with pytest.raises(ValueError, match="mask \\+ replace <= 1"):
        TokenAugment(tokenizer, mask=0.8, replace=0.5)


def test_word_tokenizer_reads_words_of_any_script_and_reports_wordless_captions(caplog):
    import logging
    import unicodedata

    captions = ["café naïve", unicodedata.normalize("NFD", "a café"), "猫が座っている",
                "🐱 🐶", "!!!", "a red circle"]
    with caplog.at_level(logging.WARNING):
        tokenizer = WordTokenizer().fit(captions)
    assert tokenizer.split("Café NAÏVE") == ["café", "naïve"]  # not caf, na, ve
    assert tokenizer.split(unicodedata.normalize("NFD", "café")) == ["café"]  # accent kept
    assert tokenizer.split("猫が座っている") == ["猫が座っている"]
    assert tokenizer.split("a red-circle, 3D") == ["a", "red", "circle", "3d"]  # ASCII as before
    unk = tokenizer.index["<unk>"]
    assert unk not in tokenizer.encode("a café naïve")
    assert tokenizer.wordless_captions == 2
    assert "2 of 6 training captions hold no word" in caplog.text
    assert "'🐱 🐶', '!!!'" in caplog.text
    assert tokenizer.encode("🐱") == [unk]
