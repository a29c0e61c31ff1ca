"""Every registered name builds from a config: a test generated from the registry, which
checks every built-in model against its contract (docs/plugins.md, "Models: the contract").

A new component must add an example config here, or this test fails.
"""

import pytest
import torch

import mmgoal  # noqa: F401
from mmgoal import registry
from mmgoal.data.tokenizers import WordTokenizer
from mmgoal.structures import ObjectiveInputs

TOKENIZER = WordTokenizer(vocab=["a", "red", "circle"])
EXAMPLES = {
    "MODELS": {
        "DualEncoder": {"image_encoder": {"type": "TimmImageEncoder",
                                          "model_name": "mmgoal_small_cnn",
                                          "model_kwargs": {"widths": [4]}},
                        "text_encoder": {"type": "GRUTextEncoder", "word_dim": 4,
                                         "hidden_size": 4}, "embed_dim": 4},
        "SCAN": {"image_encoder": {"type": "PrecomputedRegionEncoder", "feature_dim": 8},
                 "text_encoder": {"type": "GRUTextEncoder", "word_dim": 4, "hidden_size": 4},
                 "embed_dim": 4, "text_projection": "linear", "direction": "i2t",
                 "pooling": "lse", "lambda_lse": 20.0},
        "XVLM": {"vision": {"model_name": "vit_tiny_patch16_224",
                            "model_kwargs": {"img_size": 16, "patch_size": 8, "embed_dim": 8,
                                             "depth": 1, "num_heads": 1}},
                 "text": {"config": {"model_type": "bert", "hidden_size": 8,
                                     "num_hidden_layers": 2, "num_attention_heads": 1,
                                     "intermediate_size": 8}},
                 "fusion_layers": 1, "embed_dim": 4},
        # random weights, shrunk (tests/models/test_clip.py loads files and compares)
        "OpenCLIP": {"model_name": "ViT-B-32", "model_kwargs": {
            "embed_dim": 4, "vision_cfg": {"image_size": 16, "layers": 1, "width": 8,
                                           "patch_size": 8, "head_width": 8},
            "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 8, "heads": 1,
                         "layers": 1}}},
        "HFCLIP": {"config": {"model_type": "clip", "projection_dim": 4,
                              "text_config": {"vocab_size": 8, "hidden_size": 8,
                                              "intermediate_size": 8, "num_hidden_layers": 1,
                                              "num_attention_heads": 1},
                              "vision_config": {"image_size": 16, "patch_size": 8,
                                                "hidden_size": 8, "intermediate_size": 8,
                                                "num_hidden_layers": 1,
                                                "num_attention_heads": 1}}},
    },
    "CONSTRAINTS": {"CCRConstraint": {"weight": 0.1, "margin": 0.2,
                                      "reverse": "negated_softmax"},
                    "CCSConstraint": {"weight": 1.0, "margin": 0.0, "reduction": "mean"}},
    "ENCODERS": {
        "TimmImageEncoder": {"model_name": "mmgoal_small_cnn", "model_kwargs": {"widths": [4]}},
        "GRUTextEncoder": {"word_dim": 4, "hidden_size": 4},
        "PrecomputedRegionEncoder": {"feature_dim": 8, "token_dropout": 0.2},
        "RoIRegionEncoder": {"model_name": "mmgoal_small_cnn", "model_kwargs": {"widths": [4]}},
        "HFTextEncoder": {"config": {"model_type": "bert", "hidden_size": 8,
                                     "num_hidden_layers": 1, "num_attention_heads": 1,
                                     "intermediate_size": 8}},
    },
    "OBJECTIVES": {"TripletLoss": {"margin": 0.1},
                   "GoalObjective": {"triplet": "cir", "pair": "sig_ms"},
                   "NTXentHardLoss": {"tau": 5.0}, "BinomialDevianceLoss": {"beta": 20.0},
                   "CircleLoss": {"margin": 0.3}, "MultiSimilarityLoss": {"eps": 0.2},
                   "InfoNCELoss": {"temperature": 0.05},
                   "SigLIPLoss": {"init_bias": -5.0},
                   "ITMLoss": {"weight": 0.5, "temperature": 0.1},
                   "ObjectiveSum": {"terms": [{"type": "InfoNCELoss"}, {"type": "ITMLoss"}]},
                   # need a [MASK] tokenizer, the batch and heads: test_pretraining.py
                   "MLMLoss": None, "BoxGroundingLoss": None},
    # weights are functions, exercised combination by combination in tests/objectives/test_goal.py
    "TRIPLET_WEIGHTS": {"con": None, "nca": None, "cir": None},
    "PAIR_WEIGHTS": {"con": None, "lin": None, "sig": None, "lin_ms": None, "sig_ms": None},
    # None: needs local files; OpenCLIPTokenizer's BPE vocabulary ships with open_clip
    "TOKENIZERS": {"WordTokenizer": {}, "HFTokenizer": None,
                   "OpenCLIPTokenizer": {"model_name": "ViT-B-32"}},
    "DATASETS": {"ShardDataset": None, "MixtureDataset": None},  # need shards: tests/data/
    "TRANSFORMS": {"Resize": {"size": 8}, "CenterCrop": {"size": 8},
                   "RandomResizedCrop": {"size": 8}, "RandomHorizontalFlip": {},
                   "ColorJitter": {"brightness": 0.1}, "ToTensor": {},
                   "Normalize": {"mean": [0.5] * 3, "std": [0.5] * 3},
                   "RandomErasing": {},
                   "TimmTransform": {"model_name": "efficientnet_lite0", "image_size": 8},
                   "OpenCLIPTransform": {"model_name": "ViT-B-32", "image_size": 8},
                   "HFImageProcessor": None},  # None: needs a processor's folder
    "HOOKS": {"ObjectiveWarmup": {"epochs": 1, "attributes": {"margin": 0.0}},
              "FreezeSchedule": {"frozen": ["image_encoder"], "unfreeze": {1: ["image_encoder"]}}},
    "POOLERS": {"MeanPool": {}, "MaxPool": {}, "GPO": {"d_pe": 8, "d_hidden": 4}},
    # its hyperparameters; tests/models/test_lora.py puts it into OpenCLIP and HFCLIP models
    "ADAPTERS": {"lora": {"r": 2, "alpha": 4.0}},
    # building a logger writes nothing; tests/engine/test_loggers.py opens them in a run
    "LOGGERS": {"TensorBoardLogger": {"flush_secs": 5}, "WandbLogger": {"mode": "offline"}},
    "TEXT_AUGMENTS": {"TokenAugment": {"p": 0.1}},
    # remaps are functions, exercised in tests/models/test_pretrained.py
    "CHECKPOINT_REMAPS": {"timm": None, "efficientnet_pytorch": None},
    "OPTIMIZERS": {"AdamW": {"lr": 1e-3}, "Adam": {"lr": 1e-3}, "SGD": {"lr": 1e-3}},
    "SCHEDULES": {"constant": {"warmup_steps": 2}, "cosine": {"min_ratio": 0.1},
                  "linear": {"warmup_ratio": 0.1}, "step": {"milestones": [2], "gamma": 0.5}},
    # deepspeed and accelerate start process groups and global state:
    # tests/engine/test_distributed.py and test_strategies.py build them
    "STRATEGIES": {"torch": {"device": "cpu"}, "single": {}, "ddp": {"bucket_mb": 1.0},
                   "deepspeed": None,
                   "accelerate": None},
    # sources read data sets from disk: tests/data/test_sources.py and
    # test_caption_sources.py build each on fixtures
    "SHARD_SOURCES": {"karpathy": None, "precomputed": None, "entities": None, "csv": None,
                      "folder": None, "hf": None},
}
REGISTRIES = [name for name, value in vars(registry).items()
              if isinstance(value, registry.Registry)]


@pytest.mark.parametrize("registry_name", REGISTRIES)
def test_every_registered_name_has_an_example_that_builds(registry_name):
    reg = getattr(registry, registry_name)
    examples = EXAMPLES.get(registry_name, {})
    assert sorted(examples) == reg.names(), f"add example configs for {registry_name}"
    for name, kwargs in examples.items():
        if kwargs is None:
            continue
        context = {"tokenizer": TOKENIZER}
        if registry_name == "OPTIMIZERS":
            context["params"] = [torch.nn.Parameter(torch.zeros(2))]
        built = reg.build({"type": name, **kwargs}, **context)
        assert built is not None
        if registry_name == "OBJECTIVES":  # every objective follows the contract
            torch.manual_seed(0)
            sims = torch.randn(4, 4, requires_grad=True)
            # the extras the trainer passes: a cross encoder and its features (ITM needs them)
            model = registry.MODELS.build({"type": "XVLM", **EXAMPLES["MODELS"]["XVLM"]},
                                          tokenizer=TOKENIZER)
            batch = {"images": torch.randn(4, 3, 16, 16),
                     **TOKENIZER(["a red circle", "a circle", "red", "a red red circle"])}
            out = built(ObjectiveInputs(sims, positives=torch.eye(4, dtype=torch.bool),
                                        model=model, image_features=model.encode_image(batch),
                                        text_features=model.encode_text(batch)))
            loss = sum(v for k, v in out.items() if k.endswith("_loss"))
            loss.backward()
            if name == "ITMLoss":  # the scores only pick the negatives; the fusion learns
                assert model.itm_head.weight.grad.abs().sum() > 0
            else:
                assert torch.isfinite(sims.grad).all() and sims.grad.abs().sum() > 0


# What each built-in model offers beyond the required contract.
CAPABILITIES_OF = {"DualEncoder": {"TowerLockingModel"}, "SCAN": {"CrossAttentionModel"},
                   "XVLM": {"MatchingModel", "MaskedLanguageModel", "BoxPredictingModel"},
                   "OpenCLIP": {"TemperatureModel", "LogitBiasModel", "TowerLockingModel"},
                   "HFCLIP": {"TemperatureModel", "LogitBiasModel", "TowerLockingModel"}}


@pytest.mark.parametrize("name", registry.MODELS.names())
def test_every_model_follows_the_model_contract(name):
    """docs/plugins.md's model Protocol: the required methods, with the protocol's
    parameters, for every registered model; and exactly the capabilities it claims."""
    import inspect

    from mmgoal import contract

    model = registry.MODELS.build({"type": name, **EXAMPLES["MODELS"][name]},
                                  tokenizer=TOKENIZER)
    assert isinstance(model, contract.RetrievalModel)
    offered = {protocol.__name__ for protocol in contract.CAPABILITIES
               if isinstance(model, protocol)}
    assert offered == CAPABILITIES_OF[name]
    for protocol in (contract.RetrievalModel, *contract.CAPABILITIES):
        if not isinstance(model, protocol):
            continue
        for method in ("encode_image", "encode_text", "similarity", "attention", "match_logits",
                       "mlm_logits", "predict_boxes", "temperature", "logit_bias",
                       "lock_image_tower", "lock_text_tower"):
            if method not in vars(protocol):
                continue
            wanted = [p for p in inspect.signature(getattr(protocol, method)).parameters
                      if p != "self"]
            given = list(inspect.signature(getattr(model, method)).parameters)
            assert given[:len(wanted)] == wanted, (name, method, given)
    with pytest.raises(ValueError, match=r"ITM re-ranking\) needs a MatchingModel "
                                         r"\(match_logits\(\)\); DualEncoder is not one"):
        contract.require(registry.MODELS.build({"type": "DualEncoder",
                                                **EXAMPLES["MODELS"]["DualEncoder"]},
                                               tokenizer=TOKENIZER),
                         contract.MatchingModel, "evaluation.rerank_k (ITM re-ranking)")
