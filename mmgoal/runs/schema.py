"""The run config's schema: every section, its keys and their defaults, in one place.

Sections the trainer reads itself (``train``, ``data``, ``evaluation``) are
:class:`~mmgoal.config.ConfigSection` dataclasses; a section that builds a registered
component holds a ``type`` and that class's keyword arguments, a
:func:`~mmgoal.config.component` field naming its registry, so :class:`RunConfig` alone says
what the sections are. Keys a builder reads itself (``optimizer.paramwise``) are declared on
its registry (:meth:`~mmgoal.registry.Registry.read_by_builder`). Every key: docs/configs.md.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from mmgoal.config import (
    ConfigSection,
    MatmulPrecision,
    Precision,
    apply_override,
    component,
    load_config,
    override_key,
    raise_problems,
)
from mmgoal.data.coco import check_caption_ids
from mmgoal.data.remote import expand_shards, split_folder
from mmgoal.data.tars import MAX_SAMPLE_BYTES
from mmgoal.registry import (
    ADAPTERS,
    CONSTRAINTS,
    DATASETS,
    ENCODERS,
    HOOKS,
    LOGGERS,
    MODELS,
    OBJECTIVES,
    OPTIMIZERS,
    PAIR_WEIGHTS,
    POOLERS,
    SCHEDULES,
    STRATEGIES,
    TEXT_AUGMENTS,
    TOKENIZERS,
    TRANSFORMS,
    TRIPLET_WEIGHTS,
    ConfigError,
    Registry,
    UnknownNameError,
    import_custom_modules,
)

logger = logging.getLogger(__name__)

LRScaling = Literal["none", "linear", "sqrt"]
Scoring = Literal["local", "replicated"]  # train.scoring: how several ranks score a batch
# what a test gallery reports (mmgoal/evaluation/protocols.py, docs/reference/retrieval.md)
PROTOCOLS = ("coco", "eccv", "cxc", "pm")


@dataclass
class ScoringConfig(ConfigSection):
    """``evaluation``: how a gallery is scored (:func:`mmgoal.evaluation.gallery.score_gallery`,
    ITM re-ranking), what the test split reports, and a zero-shot set every validation
    classifies (docs/configs.md, "Sections")."""

    MINIMUM: ClassVar[dict[str, float]] = {"block_images": 1, "rerank_k": 0,
                                           "rerank_batch_size": 1}

    block_images: int = 128
    max_block_mb: float | None = None
    matmul_precision: MatmulPrecision = "highest"
    rerank_k: int = 0
    rerank_batch_size: int = 128
    protocols: list[str] = field(default_factory=lambda: ["coco"])
    pm_dir: str | None = None
    zeroshot: dict | None = None

    def __post_init__(self) -> None:
        if self.zeroshot is not None:
            if (not isinstance(self.zeroshot, dict) or set(self.zeroshot) - {"root", "split"}
                    or not isinstance(self.zeroshot.get("root"), str)):
                raise ValueError(f"evaluation.zeroshot must be {{root: DIR, split: test}} "
                                 f"(a zero-shot classification set, docs/models.md); got "
                                 f"{self.zeroshot!r}")
            self.zeroshot = {"split": "test", **self.zeroshot}
        unknown = [p for p in self.protocols if p not in PROTOCOLS]
        if unknown or not isinstance(self.protocols, list):
            raise ValueError(f"evaluation.protocols must be a list of {', '.join(PROTOCOLS)}; "
                             f"got {self.protocols!r}")
        if "pm" in self.protocols and not self.pm_dir:
            raise ValueError("evaluation.protocols lists pm, whose positives (over 140 MB) do "
                             "not ship with eccv_caption: download pm_image_to_caption.json "
                             "and pm_caption_to_image.json (https://github.com/naver-ai/"
                             "eccv-caption, 'Download the full data') and set "
                             "evaluation.pm_dir to their folder")
        if self.max_block_mb is not None and self.max_block_mb <= 0:
            raise ValueError(f"evaluation.max_block_mb must be above 0, got {self.max_block_mb}")

    @classmethod
    def of(cls, scoring: ScoringConfig | dict | None) -> ScoringConfig:
        """``scoring`` as a ``ScoringConfig`` (a mapping of its keys, or the defaults)."""
        return scoring if isinstance(scoring, cls) else cls.from_dict(scoring, "evaluation")


@dataclass
class TrainConfig(ConfigSection):
    """``train``: the loop, where it runs and how (docs/configs.md lists every key)."""

    MINIMUM: ClassVar[dict[str, float]] = {
        "epochs": 0, "clip_grad": 0, "log_every": 1, "eval_every": 0,
        "checkpoint_every_steps": 0, "keep_epochs": 0, "max_nonfinite_steps": 1,
        "samples_per_epoch": 1, "accumulate_steps": 1, "reference_batch": 1,
        "grad_cache_chunk": 1, "tile_rows": 1, "tile_cols": 1,
        "lock_image_unlocked_groups": 0, "lock_text_unlocked_layers": 0,
        "eval_every_steps": 0, "early_stopping_patience": 0}
    epochs: int = 10
    seed: int = 0
    # freeze a tower for the whole run but its last N layer groups (open_clip_train's
    # --lock-image, --lock-text; docs/models.md, "Training schedules")
    lock_image: bool = False
    lock_image_unlocked_groups: int = 0
    lock_text: bool = False
    lock_text_unlocked_layers: int = 0
    clip_grad: float = 2.0
    log_every: int = 10
    eval_every: int = 1
    # also validate every N steps (0: at epoch ends only), as Hugging Face's eval_steps
    eval_every_steps: int = 0
    # the validation metric best.pt maximises (rsum, zeroshot_top1, i2t_r1...)
    best_metric: str = "rsum"
    # stop after this many validations without a gain of best_metric (0: never)
    early_stopping_patience: int = 0
    eval_before_training: bool = False
    checkpoint_every_steps: int = 0
    # the resumable checkpoints of the last N epochs' ends kept as checkpoints/epoch_<E>.pt
    # beside last.pt (docs/configs.md, "What a run writes"); 0: none
    keep_epochs: int = 0
    max_nonfinite_steps: int = 5
    progress: bool = True
    samples_per_epoch: int | None = None
    accumulate_steps: int = 1
    gather_features: bool = True
    # local: each rank scores its rows (docs/distributed.md, "Local scoring"); replicated:
    # every rank the whole global matrix
    scoring: Scoring = "local"
    # encode a batch this many pairs at a time, caching the features' gradients
    # (docs/distributed.md, "Gradient caching"); null: the whole batch with its graph
    grad_cache_chunk: int | None = None
    # the score tiles an objective streams (docs/objectives.md, "Score tiles"): images x
    # texts scored at once; null: the scorer's default (1024 x 4096 for a dot product,
    # 32 x 32 pairs for cross attention)
    tile_rows: int | None = None
    tile_cols: int | None = None
    scale_lr: LRScaling = "none"
    reference_batch: int | None = None
    # where and how (docs/getting_started.md, "Training on GPUs")
    device: str = "auto"
    precision: Precision = "fp32"
    matmul_precision: MatmulPrecision = "high"
    cudnn_benchmark: bool = True
    sync_bn: bool = False
    compile: bool = False

    def __post_init__(self) -> None:
        for side, what in (("image", "groups"), ("text", "layers")):
            unlocked = getattr(self, f"lock_{side}_unlocked_{what}")
            if unlocked and not getattr(self, f"lock_{side}"):
                raise ValueError(f"train.lock_{side}_unlocked_{what}: {unlocked} leaves part "
                                 f"of a locked tower trainable; set train.lock_{side} "
                                 f"(--lock-{side}) too, or remove it")


@dataclass
class SplitConfig(ConfigSection):
    """``data.val`` / ``data.test``: an evaluation gallery."""

    MINIMUM: ClassVar[dict[str, float]] = {"folds": 1}
    shards: str | list[str]  # local files, http(s):// URLs or pipe: commands
    folds: int = 1  # COCO 1K: 5 folds of the 5K test images, metrics averaged
    caption_key: str | None = None  # one caption per sample from this member (txt)


@dataclass
class DataConfig(ConfigSection):
    """``data``: the tokenizer, the splits and the image pipeline. ``tokenizer``,
    ``train_transforms`` and ``eval_transforms`` left null are the model's own, and
    ``image_size`` null its own size (:mod:`mmgoal.runs.preprocessing`)."""

    MINIMUM: ClassVar[dict[str, float]] = {"image_size": 1, "num_workers": 0,
                                           "eval_batch_size": 1, "max_sample_bytes": 1}
    train: dict = component(DATASETS)  # ShardDataset, MixtureDataset
    tokenizer: dict | None = component(TOKENIZERS, default=None)
    val: SplitConfig | None = None
    test: SplitConfig | None = None
    image_size: int | None = None
    num_workers: int = 1
    train_transforms: list | None = None
    eval_transforms: list | None = None
    eval_batch_size: int = 256
    # a sample whose tar members hold more is skipped unread (mmgoal/data/tars.py)
    max_sample_bytes: int = MAX_SAMPLE_BYTES

    def __post_init__(self) -> None:
        # a folder names its split's shards (split_folder): written out as the glob
        def in_folder(source: Any) -> Any:
            return ({**source, "shards": split_folder(source["shards"], "train")}
                    if isinstance(source, dict) and "shards" in source else source)

        if isinstance(self.train, dict):
            sources = self.train.get("sources")
            self.train = (in_folder(self.train) if not isinstance(sources, list) else
                          {**self.train, "sources": [in_folder(s) for s in sources]})
        for name in ("val", "test"):
            if getattr(self, name) is not None:
                getattr(self, name).shards = split_folder(getattr(self, name).shards, name)

    def training_sources(self) -> list[dict]:
        """The shard sections of the training split: itself, or a mixture's sources."""
        return training_sources(self.train)


@dataclass
class RunConfig(ConfigSection):
    """A whole run: what :class:`~mmgoal.engine.trainer.Trainer` builds and trains."""

    model: dict = component(MODELS)
    objective: dict = component(OBJECTIVES)
    data: DataConfig
    optimizer: dict = component(OPTIMIZERS)
    schedule: dict = component(SCHEDULES, default_factory=lambda: {"type": "constant"})
    train: TrainConfig = field(default_factory=TrainConfig)
    strategy: dict = component(STRATEGIES, default_factory=lambda: {"type": "torch"})
    evaluation: ScoringConfig = field(default_factory=ScoringConfig)
    hooks: list[dict] = component(HOOKS, default_factory=list)
    # metrics.jsonl is always written
    loggers: list[dict] = component(LOGGERS, default_factory=list)
    constraints: list[dict] = component(CONSTRAINTS, default_factory=list)
    custom_imports: list[str] = field(default_factory=list)
    load_from: str | None = None

    def __post_init__(self) -> None:
        if "precision" in self.strategy:
            raise ValueError(f"strategy.precision is now train.precision: move "
                             f"'precision: {self.strategy['precision']}' under train")
        for name in ("model", "objective", "optimizer", "schedule", "strategy"):
            section = getattr(self, name)
            if not isinstance(section, dict) or "type" not in section:
                raise ValueError(f"'{name}' must be a mapping with a 'type' key (a "
                                 f"{self.components()[name].name} name), got {section!r}")
        if self.train.eval_before_training and self.data.val is None:
            raise ValueError("train.eval_before_training evaluates on data.val, which the "
                             "config lacks: add data.val (shards) or set it to false")


@dataclass
class ModelDataConfig(ConfigSection):
    """``data`` of a model used, not trained: its tokenizer and eval preprocessing (null:
    the model's own, as in :class:`DataConfig`)."""

    MINIMUM: ClassVar[dict[str, float]] = {"image_size": 1, "eval_batch_size": 1,
                                           "max_sample_bytes": 1, "num_workers": 0}
    tokenizer: dict | None = component(TOKENIZERS, default=None)
    image_size: int | None = None
    eval_transforms: list | None = None
    eval_batch_size: int = 256
    max_sample_bytes: int = MAX_SAMPLE_BYTES
    num_workers: int = 1  # the evaluation's decoding workers, as DataConfig's


@dataclass
class ModelConfig(ConfigSection):
    """A model to encode and score with (``mmgoal.from_config``): a config with only
    ``model`` (and ``data.tokenizer``, eval preprocessing, ``evaluation``) is enough.
    A training config holds one too (:func:`load_model_config`)."""

    model: dict = component(MODELS)
    data: ModelDataConfig = field(default_factory=ModelDataConfig)
    evaluation: ScoringConfig = field(default_factory=ScoringConfig)
    custom_imports: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.model, dict) or "type" not in self.model:
            raise ValueError(f"'model' must be a mapping with a 'type' key (a model name), "
                             f"got {self.model!r}")


def training_sources(train_cfg: dict) -> list[dict]:
    """The shard sections of a training split: itself, or a mixture's sources."""
    return list(train_cfg.get("sources") or [train_cfg])


def check_data_paths(cfg: dict) -> None:
    """Fail early, with what the folders hold, when splits' shards are missing (every
    split's said at once)."""
    problems: list[Exception] = []
    for split in ("train", "val", "test"):
        section = cfg.get("data", {}).get(split)
        for source in training_sources(section) if section else []:
            try:
                expand_shards(source["shards"])
            except (FileNotFoundError, ValueError) as error:
                problems.append(type(error)(f"data.{split}: {error}"))
    raise_problems(problems)


def check_test_shards(cfg: dict) -> None:
    """Before a run trains, what its test split needs for ``evaluation.protocols``
    (:func:`mmgoal.data.coco.check_caption_ids`)."""
    test = (cfg.get("data") or {}).get("test")
    if test:
        check_caption_ids(test["shards"], ScoringConfig.of(cfg.get("evaluation")).protocols)


# The registry that builds each component section (lists: each of their items), and the
# schema's sections by dotted path: both read off RunConfig.
REGISTRY_OF_SECTION: dict[str, Registry] = RunConfig.components()
SECTIONS: dict[str, type[ConfigSection]] = RunConfig.sections()
# Where a nested ``type`` (an encoder inside a model, a term of an objective) is looked up.
NESTED_REGISTRIES = (MODELS, ENCODERS, POOLERS, ADAPTERS, OBJECTIVES, DATASETS, TOKENIZERS,
                     TRANSFORMS, TEXT_AUGMENTS, TRIPLET_WEIGHTS, PAIR_WEIGHTS, HOOKS, CONSTRAINTS)


def resolve_config(cfg: dict, schema: type[ConfigSection] = RunConfig) -> dict:
    """``cfg`` checked against the schema, with every default of the trainer's sections
    (or of another ``schema``: :class:`ModelConfig`)."""
    return schema.from_dict(cfg, "").to_dict()


def known_keys(path: list[str], mapping: dict) -> Iterable[str]:
    """The keys ``mapping`` (at ``path`` in a resolved config) may hold beyond its own:
    a schema section's fields, or the parameters of the component its ``type`` names."""
    dotted = ".".join(path)
    # ModelConfig's sections know a subset of these keys (its from_dict refuses the rest)
    if dotted in SECTIONS:
        return SECTIONS[dotted].keys()
    type_name = mapping.get("type")
    if not isinstance(type_name, str):
        return ()
    owner = REGISTRY_OF_SECTION.get(dotted) or REGISTRY_OF_SECTION.get(path[0])
    registries = [owner] if owner is not None and type_name in owner else NESTED_REGISTRIES
    builder = REGISTRY_OF_SECTION[dotted].builder_keys if dotted in REGISTRY_OF_SECTION else None
    return [*(key for registry in registries if type_name in registry
              for key in registry.parameters(type_name)[0]),
            *(builder.keys() if builder else ())]


def load_run_config(path: str | os.PathLike, overrides: Iterable[str] = (), *,
                    trust_custom_imports: bool = True) -> dict:
    """A run config from a file: ``_base_`` merged, defaults filled in, overrides applied.
    ``trust_custom_imports``: training imports them; printing or checking a config you
    received should not (:func:`with_overrides`)."""
    return with_overrides(load_config(path), overrides, beside=Path(path).parent,
                          trust_custom_imports=trust_custom_imports, source=f"config {path}")


def load_model_config(config: str | os.PathLike | dict, overrides: Iterable[str] = (), *,
                      trust_custom_imports: bool = False) -> dict:
    """The config (a file or a mapping) of a model to use: a training config resolved as a
    run's, or one holding only what :class:`ModelConfig` knows, with its defaults;
    ``custom_imports`` only with ``trust_custom_imports`` (:func:`with_overrides`)."""
    beside, source = None, "the config"
    if not isinstance(config, dict):
        beside, source, config = Path(config).parent, f"config {config}", load_config(config)
    data = config.get("data")
    model_only = set(config) <= set(ModelConfig.keys()) and \
        (not isinstance(data, dict) or set(data) <= set(ModelDataConfig.keys()))
    # a model is used: the sections that build it are checked, not the training's
    return with_overrides(config, overrides, beside, ModelConfig if model_only else RunConfig,
                          trust_custom_imports=trust_custom_imports, source=source,
                          checked=ModelConfig)


def with_overrides(cfg: dict, overrides: Iterable[str] = (),
                   beside: str | os.PathLike | None = None,
                   schema: type[ConfigSection] = RunConfig, *,
                   trust_custom_imports: bool = False, source: str = "the config",
                   checked: type[ConfigSection] | None = None,
                   typed: bool = False) -> dict | ConfigSection:
    """``cfg`` resolved, with ``--cfg-options`` applied to any key the schema knows, and the
    component sections of ``checked`` (default: ``schema``'s) checked against their
    registries: a model to use (``checked=ModelConfig``) imports no optimizer, strategy or
    logger module to check sections it never builds.

    With ``trust_custom_imports``, the config's ``custom_imports`` are imported first (also
    from ``beside``, its folder), so overrides may name their components' options. Without,
    none is: a received config could run code through them (docs/received_files.md); a
    warning names them, and a component only they register is an error saying how to allow.
    ``typed``: the ``schema`` object itself (what the trainer takes), not its dict.
    """
    try:
        config = schema.from_dict(cfg, "")
        cfg, parsed = config.to_dict(), True
    except ValueError:  # said with the rest, once the overrides are applied
        cfg, parsed = copy.deepcopy(cfg), False
    not_imported: list[str] = []
    custom_imports = cfg.get("custom_imports") or []
    if trust_custom_imports:
        import_custom_modules(custom_imports, beside=beside)
    elif custom_imports:
        not_imported = list(custom_imports)
        warn_not_imported(not_imported, source)
    overrides = list(overrides)
    problems: list[Exception] = []  # the overrides' and the sections': said together
    for override in overrides:
        try:
            apply_override(cfg, override, known_keys)
        except ValueError as error:
            problems.append(error)
    if overrides or not parsed:  # what they set is checked as the file's keys were
        try:
            config = schema.from_dict(cfg, "")
            cfg = config.to_dict()
        except ValueError as error:
            problems.append(error)
    try:  # the components too, before a run is told of any of them
        check_components(cfg, not_imported, (checked or schema).components())
    except ConfigError as error:
        swapped = [k for k in map(override_key, overrides) if k.endswith(".type")]
        if not swapped or isinstance(error, UnknownNameError):
            problems.append(error)
        else:
            section = swapped[0].removesuffix(".type")
            problems.append(ConfigError(
                f"{error}. {swapped[0]} changed the component's type and kept the options "
                f"of the old one: to switch a component, replace its whole section, e.g. "
                f"--cfg-options '{section}={{type: NAME, option: value}}'"))
    except ValueError as error:  # several sections' problems
        problems.append(error)
    raise_problems(problems)
    return config if typed else cfg


def warn_not_imported(modules: list[str], source: str) -> None:
    """Say that ``source``'s config lists ``custom_imports`` that were not imported."""
    logger.warning("%s lists custom_imports %s; they were not imported (%s)", source,
                   ", ".join(modules), TRUST_HINT)


TRUST_HINT = ("a received config or checkpoint could run code through them; if you trust it, "
              "import them with --trust-custom-imports, or trust_custom_imports=True in "
              "Python")


def check_components(cfg: dict, not_imported: Iterable[str] = (),
                     sections: dict[str, Registry] | None = None) -> None:
    """Every component section (of ``sections``, dotted path -> registry; default: a run's)
    before anything is built: a registered ``type`` (an ``UnknownNameError`` with the
    closest match; naming ``not_imported``, the config's custom_imports that were left
    out, where there are some), known keys of the right types."""
    try:
        _check_components(cfg, REGISTRY_OF_SECTION if sections is None else sections)
    except UnknownNameError as error:
        not_imported = list(not_imported)
        if not not_imported:
            raise
        raise UnknownNameError(f"{error} The config's custom_imports ({', '.join(not_imported)}) "
                               f"were not imported: {TRUST_HINT}") from None


def _check_components(cfg: dict, sections: dict[str, Registry]) -> None:
    problems: list[Exception] = []
    for dotted, registry in sections.items():
        try:
            _check_section(cfg, dotted, registry)
        except ValueError as error:
            problems.append(error)
    raise_problems(problems)


def _check_section(cfg: dict, dotted: str, registry: Registry) -> None:
    section = cfg
    for key in dotted.split("."):
        section = section.get(key) if isinstance(section, dict) else None
    items = section if isinstance(section, list) else [section]
    for index, item in enumerate(items):
        if isinstance(item, dict):
            builder = registry.builder_keys
            builder_keys = builder.keys() if builder else ()
            if builder:
                builder.from_dict({k: v for k, v in item.items() if k in builder_keys},
                                  dotted)
            item = {k: v for k, v in item.items() if k not in builder_keys}
            where = f"{dotted}.{index}" if isinstance(section, list) else dotted
            registry.check(item, where, provided=registry.parameters(item["type"])[0]
                           if "type" in item and item["type"] in registry else ())
