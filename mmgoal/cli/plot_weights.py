"""Draw GOAL's weight maps (the paper's Figures 2 and 3) for configured hyperparameters.

    mmgoal plot-weights --out docs/goal_weights.png
    mmgoal plot-weights configs/goal/quickstart_goal.yaml \
        --cfg-options "objective.triplet={'type': 'cir', 'tau': 5}"
    mmgoal plot-weights --set tau=1 cir_offset=0 --out weights_tau1.png

Figure 2: every triplet weight T(s_p, s_n) as a map over s_p (x) and s_n (y);
Figure 3: every pair weight, P+ against s_p and P- against s_n. Each weight is
drawn with its default options, except the two a config's ``GoalObjective``
names (with the options it gives them); ``--set NAME=VALUE`` then sets an
option on every weight that takes it. The multi-similarity pair weights depend
on the rest of the batch; they are drawn with empty comparison sets, where they
equal ``sig`` and ``lin``. A ``lam: auto`` weight is drawn at its ``lam_init``.
"""

from __future__ import annotations

import difflib
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from mmgoal.cli.arguments import INPUT_ERRORS, config_argument, print_error, tool_parser
from mmgoal.config import load_config, parse_value
from mmgoal.extras import pyplot, require_extra
from mmgoal.files import save_figure
from mmgoal.registry import OBJECTIVES

if TYPE_CHECKING:  # torch is imported once the arguments are read: --help does without it
    import torch

    from mmgoal.objectives.goal import BoundWeight


def configured_weights(config: str | None, overrides: list[str], sets: list[str]
                       ) -> dict[str, list[BoundWeight]]:
    """Every registered weight per slot (``triplet``, ``pair``) with the options to draw it with.

    Defaults, then the config's ``GoalObjective`` for the two weights it names,
    then ``--set`` on every weight that takes the option.
    """
    from mmgoal.objectives.goal import WEIGHT_REGISTRIES, bind_weight

    weights = {slot: [bind_weight(slot, name) for name in registry.names()]
               for slot, registry in WEIGHT_REGISTRIES.items()}
    if config:
        section = load_config(config, overrides).get("objective", {})
        if section.get("type") != "GoalObjective":
            raise ValueError(f"{config}: objective.type is {section.get('type')!r}; the weights "
                             f"are drawn from a GoalObjective config")
        objective = OBJECTIVES.build(section)
        for slot, chosen in (("triplet", objective.triplet_weight),
                             ("pair", objective.pair_weight)):
            weights[slot] = [chosen if w.name == chosen.name else w for w in weights[slot]]
    every_option = sorted({k for ws in weights.values() for w in ws for k in w.options})
    for item in sets:
        key, _, value = item.partition("=")
        if key not in every_option:
            close = difflib.get_close_matches(key, every_option, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ValueError(f"--set {key}: not an option of any GOAL weight{hint}; the "
                             f"options are {', '.join(every_option)}")
        for ws in weights.values():
            for w in ws:
                if key in w.options:
                    w.options[key] = parse_value(value)
    return weights


class EmptyComparison:
    """Stands in for RelativeScores when the comparison sets are empty: every mean is ``empty``."""

    def _empty(self, *args, empty: float) -> float:
        return empty

    pos_mean_exp = neg_mean_exp = pos_mean_diff = neg_mean_diff = _empty


def call_weight(weight: BoundWeight, s_p: torch.Tensor, s_n: torch.Tensor):
    extra = {"relative": EmptyComparison()} if weight.takes_relative else {}
    if weight.adaptive_lam:  # drawn where lam: auto starts
        extra["lam"] = weight.options["lam_init"]
    return weight.fn(s_p, s_n, **{**weight.options, **extra})


def draw(weights: dict[str, list[BoundWeight]], out: Path, resolution: int = 201) -> None:
    import torch

    plt = pyplot("mmgoal plot-weights")
    grid = torch.linspace(-1, 1, resolution, dtype=torch.float64, device="cpu")
    s_p, s_n = torch.meshgrid(grid, grid, indexing="xy")
    triplets, pairs = weights["triplet"], weights["pair"]
    columns = max(len(triplets), 2)
    fig, axes = plt.subplots(2, columns, figsize=(4.4 * columns, 8.5), layout="constrained")
    for ax, triplet in zip(axes[0], triplets):
        weight = call_weight(triplet, s_p.flatten(), s_n.flatten())
        image = ax.imshow(weight.reshape(s_p.shape), origin="lower", extent=(-1, 1, -1, 1),
                          vmin=0, vmax=1, cmap="viridis")
        ax.contour(s_p, s_n, weight.reshape(s_p.shape), levels=[0.1, 0.5, 0.9], colors="white",
                   linewidths=0.7)
        ax.set(title=f"triplet weight {triplet}", xlabel="s_p", ylabel="s_n")
    fig.colorbar(image, ax=list(axes[0]), shrink=0.8)
    for ax in axes[0][len(triplets):]:
        ax.axis("off")
    positive_ax, negative_ax = axes[1][0], axes[1][1]
    for pair in pairs:
        w_pos, w_neg = call_weight(pair, grid, grid)
        style = "--" if pair.takes_relative else "-"
        positive_ax.plot(grid, w_pos, style, label=str(pair))
        negative_ax.plot(grid, w_neg, style, label=str(pair))
    positive_ax.set(title="pair weight P+ (positive pair)", xlabel="s_p", ylabel="P+")
    negative_ax.set(title="pair weight P- (negative pair)", xlabel="s_n", ylabel="P-")
    for ax in (positive_ax, negative_ax):
        ax.grid(alpha=0.3)
    for ax in axes[1][2:]:
        ax.axis("off")
    # the labels carry every option: too long to sit on the curves, so in a free panel
    legend_ax = axes[1][2] if columns > 2 else positive_ax
    legend_ax.legend(*positive_ax.get_legend_handles_labels(), loc="center", title="pair weight")
    fig.suptitle("GOAL weights (options in brackets); dashed: multi-similarity weights, "
                 "drawn with empty comparison sets")
    save_figure(fig, out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = tool_parser(__doc__)
    parser.add_argument("config", nargs="?", help="config whose GoalObjective gives options")
    parser.add_argument("--cfg-options", nargs="+", default=[], metavar="KEY=VALUE")
    parser.add_argument("--set", nargs="+", default=[], metavar="NAME=VALUE",
                        help="an option of every weight that takes it, e.g. tau=1 "
                             "cir_offset=0")
    parser.add_argument("--out", default="goal_weights.png", help="PNG file to write")
    args = parser.parse_args(argv)
    try:
        require_extra("matplotlib", "mmgoal plot-weights")
        if args.config:
            args.config = config_argument(args.config)
        weights = configured_weights(args.config, args.cfg_options, args.set)
    except (*INPUT_ERRORS, KeyError) as error:
        return print_error(error)
    draw(weights, Path(args.out))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
