"""The attributes a component may declare are read in one place (mmgoal.contract), with the
default of a component that declares none."""

import torch
from torch import nn

from mmgoal import contract
from mmgoal.data.tokenizers import WordTokenizer
from mmgoal.registry import CONSTRAINTS, MODELS, OBJECTIVES

GRU = {"type": "GRUTextEncoder", "word_dim": 8, "hidden_size": 16}


class PlainObjective(nn.Module):
    """A user's objective that declares nothing: it is given the whole score matrix."""


def test_declared_attributes_and_their_defaults():
    tokenizer = WordTokenizer().fit(["a red circle"])
    scan = MODELS.build({"type": "SCAN", "embed_dim": 16, "text_encoder": GRU,
                         "image_encoder": {"type": "PrecomputedRegionEncoder",
                                           "feature_dim": 10}}, tokenizer=tokenizer)
    dual = MODELS.build({"type": "DualEncoder", "embed_dim": 16, "text_encoder": GRU,
                         "image_encoder": {"type": "TimmImageEncoder",
                                           "model_name": "mmgoal_small_cnn",
                                           "model_kwargs": {"widths": [8, 16]}}},
                        tokenizer=tokenizer)
    bare = nn.Linear(2, 2)  # declares nothing: every default
    assert [contract.similarity_uses_tokens(m) for m in (scan, dual, bare)] == [True, False,
                                                                                 False]
    assert [contract.dot_product_scores(m) for m in (scan, dual, bare)] == [False, True, False]
    assert contract.pair_similarity(scan) is not None and contract.pair_similarity(dual) is None
    assert [contract.returns_tokens(m.image_encoder) for m in (scan, dual)] == [True, False]
    # region boxes from the precomputed regions' own boxes; a pooled CNN has none
    boxes = contract.region_boxes(scan)({"boxes": torch.tensor([[[0.0, 0.0, 0.5, 0.5]]]),
                                         "box_lengths": torch.tensor([1]),
                                         "region_lengths": torch.tensor([1])})
    assert [b.tolist() for b in boxes] == [[[0.0, 0.0, 0.5, 0.5]]]
    assert contract.region_boxes(dual) is None and contract.region_boxes(bare) is None
    # a sum of objectives works on tiles only when every term does
    infonce = OBJECTIVES.build({"type": "InfoNCELoss"})
    both = OBJECTIVES.build({"type": "ObjectiveSum", "terms": [{"type": "InfoNCELoss"},
                                                               {"type": "TripletLoss"}]})
    assert contract.works_on_tiles(infonce) and contract.works_on_tiles(both)
    both.terms.append(PlainObjective())
    assert not contract.works_on_tiles(both) and not contract.works_on_tiles(PlainObjective())
    ccr = CONSTRAINTS.build({"type": "CCRConstraint", "reduction": "mean"})
    assert contract.averages_pairs(ccr) and not contract.averages_pairs(PlainObjective())
