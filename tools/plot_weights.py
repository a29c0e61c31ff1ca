"""Draw GOAL's weight maps (the paper's Figures 2 and 3) for configured hyperparameters.

    python tools/plot_weights.py --out docs/goal_weights.png
    python tools/plot_weights.py configs/goal/quickstart_goal.yaml --cfg-options objective.tau=5
    python tools/plot_weights.py --set tau=1 cir_offset=0 --out weights_tau1.png

Figure 2: every triplet weight T(s_p, s_n) as a map over s_p (x) and s_n (y);
Figure 3: every pair weight, P+ against s_p and P- against s_n. The
multi-similarity pair weights depend on the rest of the batch; they are drawn
with empty comparison sets, where they equal ``sig`` and ``lin``.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from mmgoal.config import load_config, parse_value  # noqa: E402
from mmgoal.registry import OBJECTIVES, PAIR_WEIGHTS, TRIPLET_WEIGHTS  # noqa: E402


def goal_hyperparameters(config: str | None, overrides: list[str], sets: list[str]) -> dict:
    """GoalObjective's hyperparameters: defaults, then the config's objective, then --set."""
    objective = OBJECTIVES.build({"type": "GoalObjective"})
    hyper = dict(objective.hyper)
    if config:
        section = load_config(config, overrides).get("objective", {})
        hyper.update({k: v for k, v in section.items() if k in hyper})
    for item in sets:
        key, _, value = item.partition("=")
        if key not in hyper:
            raise ValueError(f"--set {key}: not a GOAL hyperparameter; choose from "
                             f"{', '.join(sorted(hyper))}")
        hyper[key] = parse_value(value)
    return hyper


class EmptyComparison:
    """Stands in for RelativeScores when the comparison sets are empty: every mean is ``empty``."""

    def _empty(self, *args, empty: float) -> float:
        return empty

    pos_mean_exp = neg_mean_exp = pos_mean_diff = neg_mean_diff = _empty


def call_weight(fn, s_p: torch.Tensor, s_n: torch.Tensor, hyper: dict):
    params = inspect.signature(fn).parameters
    kwargs = {k: v for k, v in hyper.items() if k in params}
    if "relative" in params:
        kwargs["relative"] = EmptyComparison()
    return fn(s_p, s_n, **kwargs)


def draw(hyper: dict, out: Path, resolution: int = 201) -> None:
    grid = torch.linspace(-1, 1, resolution, dtype=torch.float64)
    s_p, s_n = torch.meshgrid(grid, grid, indexing="xy")
    triplets = TRIPLET_WEIGHTS.names()
    pairs = PAIR_WEIGHTS.names()
    columns = max(len(triplets), 2)
    fig, axes = plt.subplots(2, columns, figsize=(4.4 * columns, 8.5), layout="constrained")
    for ax, name in zip(axes[0], triplets):
        weight = call_weight(TRIPLET_WEIGHTS.get(name), s_p.flatten(), s_n.flatten(), hyper)
        image = ax.imshow(weight.reshape(s_p.shape), origin="lower", extent=(-1, 1, -1, 1),
                          vmin=0, vmax=1, cmap="viridis")
        ax.contour(s_p, s_n, weight.reshape(s_p.shape), levels=[0.1, 0.5, 0.9], colors="white",
                   linewidths=0.7)
        ax.set(title=f"triplet weight '{name}'", xlabel="s_p", ylabel="s_n")
    fig.colorbar(image, ax=list(axes[0]), shrink=0.8)
    for ax in axes[0][len(triplets):]:
        ax.axis("off")
    positive_ax, negative_ax = axes[1][0], axes[1][1]
    for name in pairs:
        w_pos, w_neg = call_weight(PAIR_WEIGHTS.get(name), grid, grid, hyper)
        style = "--" if name.endswith("_ms") else "-"
        positive_ax.plot(grid, w_pos, style, label=name)
        negative_ax.plot(grid, w_neg, style, label=name)
    positive_ax.set(title="pair weight P+ (positive pair)", xlabel="s_p", ylabel="P+")
    negative_ax.set(title="pair weight P- (negative pair)", xlabel="s_n", ylabel="P-")
    for ax in (positive_ax, negative_ax):
        ax.legend()
        ax.grid(alpha=0.3)
    for ax in axes[1][2:]:
        ax.axis("off")
    text = ", ".join(f"{k}={v:g}" for k, v in hyper.items())
    fig.suptitle(f"GOAL weights ({text}); *_ms drawn with empty comparison sets")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config", nargs="?", help="config whose objective gives hyperparameters")
    parser.add_argument("--cfg-options", nargs="+", default=[], metavar="KEY=VALUE")
    parser.add_argument("--set", nargs="+", default=[], metavar="NAME=VALUE",
                        help="hyperparameters directly, e.g. tau=1 cir_offset=0")
    parser.add_argument("--out", default="goal_weights.png", help="PNG file to write")
    args = parser.parse_args(argv)
    try:
        hyper = goal_hyperparameters(args.config, args.cfg_options, args.set)
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    draw(hyper, Path(args.out))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
