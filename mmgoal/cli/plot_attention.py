"""Draw an image with its regions shaded by one word's attention (a cross-attention model).

    mmgoal plot-attention configs/scan/scan_synthetic.yaml \
        work_dirs/scan_synthetic/checkpoints/best.pt --index 8 --caption 1 --word triangle
    mmgoal plot-attention CONFIG CKPT --index 0 --caption 2 --word 4 --out att.png

``--index`` is the image's position in the split's shards, ``--caption`` one of
its captions, ``--word`` a word of that caption (its text, or its position in
``caption.split()``). Each region box is filled with an opacity proportional to
the word's attention weight on it (text-to-image attention) and labelled with it;
a region that covers the whole image is only named, with its weight.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mmgoal.cli.arguments import (
    INPUT_ERRORS,
    add_data_options,
    add_loading_options,
    apply_loading_options,
    config_argument,
    print_error,
    tool_parser,
)
from mmgoal.extras import pyplot
from mmgoal.files import save_figure


def nth_sample(shards, index: int) -> dict:
    """The ``index``-th readable sample of the shards, decoded."""
    from mmgoal.data.pipeline import SkipCounter, decoded_samples

    position = -1
    for position, sample in enumerate(decoded_samples(shards, SkipCounter())):
        if position == index:
            return sample
    raise ValueError(f"--index {index}: the split has only {position + 1} samples")


def word_position(caption: str, word: str) -> int:
    words = caption.split()
    if word.isdigit():
        if int(word) >= len(words):
            raise ValueError(f"--word {word}: the caption has {len(words)} words")
        return int(word)
    stripped = [w.strip(".,;:!?").lower() for w in words]
    if word.lower() not in stripped:
        raise ValueError(f"--word {word!r} is not in the caption {caption!r}")
    return stripped.index(word.lower())


def word_attention(model, tokenizer, sample: dict, transform, caption: str, position: int):
    """(region boxes as xyxy fractions (R, 4), attention weights (R,)) of one word."""
    import torch

    from mmgoal.contract import CrossAttentionModel, region_boxes, require
    from mmgoal.data.pipeline import collate_visual, transform_image

    batch = collate_visual([transform_image(sample, transform)])
    require(model, CrossAttentionModel, "mmgoal plot-attention")
    boxes_of = region_boxes(model)
    if boxes_of is None:
        raise ValueError(f"{type(model.image_encoder).__name__} cannot say where its regions "
                         f"are (no region_boxes): there is no region attention to draw")
    tokens = tokenizer.word_token_spans(caption)[position]
    if not tokens:
        raise ValueError("that word was cut by the tokenizer's max_length")
    with torch.no_grad():
        attention = model.attention(model.encode_image(batch),
                                    model.encode_text(tokenizer([caption])), direction="t2i")
        boxes = boxes_of(batch)[0]
    weights = attention.weights[0, tokens, :len(boxes)].mean(0)  # a word of several tokens
    return boxes, weights


def main(argv: list[str] | None = None) -> int:
    parser = tool_parser(__doc__)
    parser.add_argument("config")
    parser.add_argument("checkpoint")
    parser.add_argument("--split", default="test", choices=("val", "test"))
    parser.add_argument("--index", type=int, default=0, help="image position in the split")
    parser.add_argument("--caption", type=int, default=0, help="caption of that image")
    parser.add_argument("--word", required=True, help="a word of the caption, or its position")
    parser.add_argument("--cfg-options", nargs="+", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", help="PNG (default: <checkpoint>.attention_<index>_<word>.png)")
    add_data_options(parser)
    add_loading_options(parser)
    args = parser.parse_args(argv)
    from mmgoal.runs.loading import load_for_evaluation  # torch: past --help

    apply_loading_options(args)
    try:
        plt = pyplot("mmgoal plot-attention")
        args.config = config_argument(args.config)
        loaded = load_for_evaluation(args.checkpoint, args.config, args.cfg_options, device="cpu",
                                     trust_custom_imports=args.trust_custom_imports)
        model, tokenizer, transform = loaded.model, loaded.tokenizer, loaded.transform
        split = loaded.split(args.split, args.shards, args.trust_data_paths)
        sample = nth_sample(split["shards"], args.index)
        if "image" not in sample:
            raise ValueError("the sample has no image to draw (regions only)")
        if args.caption >= len(sample["captions"]):
            raise ValueError(f"--caption {args.caption}: the image has "
                             f"{len(sample['captions'])} captions")
        caption = sample["captions"][args.caption]
        position = word_position(caption, args.word)
        boxes, weights = word_attention(model, tokenizer, sample, transform, caption, position)
    except (*INPUT_ERRORS, KeyError) as error:
        return print_error(error)
    image = sample["image"]
    width, height = image.size
    fig, ax = plt.subplots(figsize=(5, 5.6))
    ax.imshow(image)
    top = float(weights.max())
    whole = []
    # Largest first, so that small regions are drawn on top of the ones that contain them.
    for box, weight in sorted(zip(boxes.tolist(), weights.tolist()),
                              key=lambda x: -(x[0][2] - x[0][0]) * (x[0][3] - x[0][1])):
        x0, y0, x1, y1 = box[0] * width, box[1] * height, box[2] * width, box[3] * height
        if (box[2] - box[0]) * (box[3] - box[1]) >= 0.95:  # the whole image: outline only
            whole.append(weight)
            continue
        alpha = 0.6 * weight / max(top, 1e-8)
        ax.add_patch(plt.Rectangle((x0, y0), x1 - x0, y1 - y0, facecolor="yellow", alpha=alpha,
                               edgecolor="red", linewidth=1.5 if weight == top else 0.5))
        ax.text(x0 + 0.5, y0 + 0.5, f"{weight:.2f}", fontsize=7, va="top", color="black",
                bbox={"facecolor": "white", "alpha": 0.6, "pad": 0.5, "linewidth": 0})
    if whole:
        ax.text(0.5, height - 0.5, "whole image: " + ", ".join(f"{w:.2f}" for w in whole),
                fontsize=7, va="bottom", color="black",
                bbox={"facecolor": "white", "alpha": 0.8, "pad": 1, "linewidth": 0})
    words = caption.split()
    words[position] = f"[{words[position]}]"
    ax.set_title("\n".join([" ".join(words[i:i + 8]) for i in range(0, len(words), 8)]),
                 fontsize=8)
    ax.axis("off")
    fig.tight_layout()
    out = Path(args.out or f"{args.checkpoint}.attention_{args.index}_{args.word}.png")
    save_figure(fig, out, dpi=120)
    print(f"attention of {words[position]!r} over {len(boxes)} regions "
          f"(max {top:.3f}) written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
