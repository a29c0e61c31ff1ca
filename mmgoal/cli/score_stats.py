"""How spread out a trained model's scores are: a check for hardest-negative collapse.

    mmgoal score-stats work_dirs/sweep/conxcon/default/seed0 [--split test] [--pairs 512]
    mmgoal score-stats configs/clip/clip_vit_b_32_coco.yaml   # a checkpoint as it is
    mmgoal score-stats RUN --shards "data/synthetic/train-{000000..000009}.tar" \
        --batch-size 2048 --pairs 4096     # the hardest negative of a batch of 2,048

Scores the first ``--pairs`` images of the split against their first captions
with a run's best checkpoint (else its latest), a checkpoint file, or the model
a config builds with the weights it names (a CLIP checkpoint before
fine-tuning: where to set GOAL's ``lam``), and prints the median positive score and
the median and quartiles of each image's hardest-negative score among the captions
of its batch (``--batch-size``, default 128: the larger the batch, the harder its
hardest negative, so measure at the training batch size). A collapsed model has
positives and hardest negatives in the same narrow band.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from mmgoal.cli.arguments import (
    INPUT_ERRORS,
    add_data_options,
    add_loading_options,
    apply_loading_options,
    config_argument,
    names_shipped_config,
    positive_int,
    print_error,
    tool_parser,
)

if TYPE_CHECKING:  # torch is imported once the arguments are read: --help does without it
    from mmgoal.runs.loading import LoadedModel


def load_model(source: Path, trust_custom_imports: bool = False) -> LoadedModel:
    """A run directory or checkpoint with its weights, or a config with the weights it names."""
    from mmgoal.runs.loading import build_from_config, load_for_evaluation

    if source.suffix in (".yaml", ".yml"):
        return build_from_config(source, device="cpu", trust_custom_imports=trust_custom_imports)
    return load_for_evaluation(source, device="cpu", trust_custom_imports=trust_custom_imports)


def score_stats(source: Path, split: str, pairs: int, trust_custom_imports: bool = False,
                shards: list[str] | None = None, trust_data_paths: bool = False,
                batch_size: int = 128) -> dict[str, float]:
    """The statistics the module docstring names, of ``pairs`` pairs of ``split`` (or of
    ``shards``; the config's are read as :meth:`LoadedModel.split` allows), each image's
    hardest negative taken among the ``batch_size`` captions of its batch."""
    import torch

    from mmgoal.data.pipeline import EvalReader, iter_eval_batches
    from mmgoal.objectives.mining import hardest_negatives

    loaded = load_model(source, trust_custom_imports)
    model, tokenizer, transform = loaded.model, loaded.tokenizer, loaded.transform
    split_cfg = loaded.split(split, shards, trust_data_paths)
    positive, negative = [], []
    with torch.no_grad():
        for batch in iter_eval_batches(EvalReader(split_cfg["shards"], batch_size, split_cfg.get(
                "caption_key")), transform):
            captions = [c[0] for c in batch["captions"]]
            texts = model.encode_text(tokenizer(captions))
            sims = model.similarity(model.encode_image(batch), texts)
            diagonal = torch.eye(len(captions), dtype=torch.bool, device=sims.device)
            text_of_image, _, _, _ = hardest_negatives(sims, diagonal)
            positive.append(sims.diagonal())
            negative.append(sims[torch.arange(len(captions), device=sims.device), text_of_image])
            if sum(len(p) for p in positive) >= pairs:
                break
    s_p, s_n = torch.cat(positive)[:pairs], torch.cat(negative)[:pairs]
    return {"epoch": loaded.epoch, "pairs": len(s_p), "positive_median": s_p.median().item(),
            "negative_median": s_n.median().item(), "negative_q25": s_n.quantile(0.25).item(),
            "negative_q75": s_n.quantile(0.75).item()}


def main(argv: list[str] | None = None) -> int:
    parser = tool_parser(__doc__)
    parser.add_argument("runs", nargs="+", help="run directories, checkpoints, or configs whose "
                                                "model loads pretrained weights")
    parser.add_argument("--split", default="test", choices=("val", "test"))
    parser.add_argument("--pairs", type=positive_int, default=512)
    parser.add_argument("--batch-size", type=positive_int, default=128,
                        help="the hardest negative is taken among this many captions")
    add_data_options(parser)
    add_loading_options(parser)
    args = parser.parse_args(argv)
    apply_loading_options(args)
    for run in args.runs:
        try:
            s = score_stats(Path(config_argument(run) if names_shipped_config(run) else run),
                            args.split, args.pairs, args.trust_custom_imports, args.shards,
                            args.trust_data_paths, args.batch_size)
        except (*INPUT_ERRORS, KeyError) as error:
            return print_error(f"{run}: {error}")
        where = "as loaded" if s["epoch"] is None else f"epoch {s['epoch']}"
        print(f"{run} ({where}, {s['pairs']} pairs): positive median "
              f"{s['positive_median']:.2f}, hardest negative median {s['negative_median']:.2f} "
              f"(quartiles {s['negative_q25']:.2f}-{s['negative_q75']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
