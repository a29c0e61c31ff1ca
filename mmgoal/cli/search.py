"""Search a gallery with a trained model: its images for a caption, or its captions for an image.

    mmgoal search work_dirs/quickstart --images 'data/synthetic/test-*.tar' \
        --query "a large red circle left of a small blue square" --top-k 8 --out hits.png
    mmgoal search RUN --images 'data/synthetic/test-*.tar' --query "a red circle" \
        --query "two green triangles"               # one row of the picture per query
    mmgoal search RUN --images photos/ --query "a dog on a beach"
    mmgoal search RUN --images 'data/synthetic/test-*.tar' --image scene.png --out c.png
    mmgoal search RUN --image scene.png --texts captions.txt

RUN is what ``mmgoal.load`` takes: a run directory (its checkpoints/best.pt), a
checkpoint or an export. ``--images`` names WebDataset shards (brace patterns and
globs; every image id is one image, as in evaluation) or image files and folders of
them. Each ``--query`` ranks the gallery's images; ``--image`` ranks captions: the
shards' (each distinct caption once) or those of ``--texts``, one per line. The
ranking is printed (rank, score, image id, file or caption); ``--out`` also draws it
(the ``plot`` extra): per query a row of its top-k images, each titled with its rank
and score, or the query image beside its top captions and their scores. A cross
encoder re-ranks by ITM as its config's ``evaluation.rerank_k`` says (``--rerank-k``).
"""

from __future__ import annotations

import argparse
import math
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mmgoal.cli.arguments import (
    INPUT_ERRORS,
    add_device_option,
    add_loading_options,
    apply_loading_options,
    positive_int,
    print_error,
    tool_parser,
)
from mmgoal.data.remote import expand_shards
from mmgoal.data.tars import IMAGE_EXTENSIONS
from mmgoal.extras import pyplot
from mmgoal.files import read_text, save_figure

if TYPE_CHECKING:  # torch is imported once the arguments are read: --help does without it
    from PIL import Image

    from mmgoal.api import Index, Retriever

MAX_COLUMNS = 8  # hits per row of the picture; a query with more hits takes several rows
MIN_COLUMNS = 3  # the picture is at least this many panels wide, for the query's title
PANEL_INCHES = 1.8  # width and height of one hit's panel
QUERY_TITLE_INCHES = 0.4  # above each query's rows
CAPTION_LINE = 62  # characters of a caption's line beside the query image (two at most)
DPI = 100


@dataclass
class ImageGallery:
    """Encoded images to search, named by image id (shards) or by path (files).

    Attributes:
        index: their encoding, for ``Retriever.search``.
        names: per image, its image id or file path.
        shards: the shards they were read from (none for image files).
    """

    index: Index
    names: list
    shards: list[str]

    def labels(self) -> list[str]:
        """Per image, what its panel says: its image id, or its file's name."""
        return [str(name) if self.shards else Path(name).name for name in self.names]

    def pictures(self, positions: list[int]) -> dict[int, Image.Image]:
        """The images at ``positions``, read again (the gallery keeps only their features)."""
        from mmgoal.api import rgb_image
        from mmgoal.data.pipeline import SkipCounter, decoded_samples

        if not self.shards:
            return {p: rgb_image(self.names[p]) for p in positions}
        wanted = {self.names[p]: p for p in positions}
        found: dict[int, Image.Image] = {}
        counter = SkipCounter()  # the samples encode_gallery skipped, skipped again
        for sample in decoded_samples(self.shards, counter):
            position = wanted.get(sample["image_id"])
            if position is None or position in found:  # a later copy of an image id
                continue
            if "image" not in sample:
                raise ValueError(f"sample {sample['key']!r} holds region features, no image "
                                 f"to draw; leave out --out to print the ranking only")
            found[position] = sample["image"]
            if len(found) == len(wanted):
                break
        return found


def is_image_file(path: Path) -> bool:
    return path.suffix.lower().lstrip(".") in IMAGE_EXTENSIONS


def gallery_files(patterns: list[str]) -> tuple[list[str], list[str]]:
    """(shards, image files) of ``--images``: folders of images, and files, globs and brace
    patterns of shards (``.tar``) or of images; one kind or the other."""
    files: list[Path] = []
    for pattern in patterns:
        if Path(pattern).is_dir():
            found = sorted(p for p in Path(pattern).iterdir() if is_image_file(p))
            if not found:
                raise FileNotFoundError(f"--images {pattern}: the folder holds no image "
                                        f"({', '.join(IMAGE_EXTENSIONS)})")
            files += found
        else:
            try:
                files += [Path(p) for p in expand_shards(pattern)]
            except FileNotFoundError as error:
                raise FileNotFoundError(f"--images: {error}") from None
    shards = [str(f) for f in files if f.suffix == ".tar"]
    images = [str(f) for f in files if is_image_file(f)]
    others = [str(f) for f in files if f.suffix != ".tar" and not is_image_file(f)]
    if others:
        raise ValueError(f"--images: {others[0]} is neither a .tar shard nor an image "
                         f"({', '.join(IMAGE_EXTENSIONS)})")
    if shards and images:
        raise ValueError("--images: give shards or image files, not both")
    return shards, images


def encoded_index(retriever: Retriever, items: list, kind: str) -> Index:
    """``retriever.index(items, kind)``, a batch at a time under a progress bar."""
    from mmgoal.api import Index
    from mmgoal.console import progress_bar
    from mmgoal.structures import cat_features

    size = retriever.batch_size
    parts = [retriever.index(items[start:start + size], kind).features
             for start in progress_bar(range(0, len(items), size), desc=f"encode {kind}",
                                       unit="batch", leave=False)]
    return Index(kind, cat_features(parts))


def image_gallery(retriever: Retriever, shards: list[str], images: list[str],
                  rerank_k: int) -> ImageGallery:
    from mmgoal.api import Index
    from mmgoal.data.pipeline import EvalReader
    from mmgoal.evaluation.gallery import encode_gallery

    if not shards:
        return ImageGallery(encoded_index(retriever, images, "images"), images, [])
    try:  # every token kept where the ITM head re-ranks (it reads them)
        gallery = encode_gallery(retriever.model, EvalReader(shards, retriever.batch_size),
                                 retriever.transform, retriever.tokenizer,
                                 keep_tokens=rerank_k > 0)
    except KeyError as error:  # the API's message for a model that does not read pixels
        raise ValueError(f"{type(retriever.model).__name__} does not encode these images: it "
                         f"reads {error} (precomputed features), which the shards lack"
                         ) from None
    return ImageGallery(Index("images", gallery.images), gallery.image_ids, shards)


def read_texts(path: str) -> list[str]:
    if not Path(path).is_file():
        raise FileNotFoundError(f"--texts {path} does not exist")
    texts = [line.strip() for line in read_text(path, "texts file").splitlines()
             if line.strip()]
    if not texts:
        raise ValueError(f"--texts {path} holds no caption (one per line)")
    return texts


def grid_shape(hits: int, max_columns: int = MAX_COLUMNS) -> tuple[int, int]:
    """(rows, columns) of one query's panels: ``hits`` panels, at most ``max_columns`` a row."""
    columns = min(hits, max_columns)
    return math.ceil(hits / columns), columns


def draw_image_hits(plt, queries: list[str], hits: list[list[tuple[int, float]]],
                    pictures: dict[int, Image.Image], labels: list[str]):
    """A contact sheet: per query (its title) its hits' images, each titled with its rank,
    score and label. Returns the figure."""
    shapes = [grid_shape(len(row)) for row in hits]
    columns = max(c for _, c in shapes)
    heights = [rows * PANEL_INCHES + QUERY_TITLE_INCHES for rows, _ in shapes]
    width = max(columns, MIN_COLUMNS)
    fig = plt.figure(figsize=(width * PANEL_INCHES, sum(heights)), layout="constrained")
    for subfig, query, row, (rows, _) in zip(
            fig.subfigures(len(queries), 1, height_ratios=heights, squeeze=False)[:, 0],
            queries, hits, shapes):
        subfig.suptitle(textwrap.shorten(query, 20 * width, placeholder="..."), fontsize=10)
        axes = list(subfig.subplots(rows, columns, squeeze=False).flat)
        for ax in axes:
            ax.axis("off")
        for rank, ((position, score), ax) in enumerate(zip(row, axes), start=1):
            ax.imshow(pictures[position])
            ax.set_title(f"{rank}. {score:.3f}\n{textwrap.shorten(labels[position], 24)}",
                         fontsize=8)
    return fig


def draw_caption_hits(plt, image: Image.Image, title: str, hits: list[tuple[int, float]],
                      captions: list[str]):
    """The query image beside its hits' captions, each with its rank and score. Returns the
    figure."""
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(3 * PANEL_INCHES + 1, max(PANEL_INCHES, 0.4 * len(hits)) + 0.5),
        width_ratios=(1, 2), layout="constrained")
    left.imshow(image)
    left.set_title(textwrap.shorten(title, 30), fontsize=9)
    for ax in (left, right):
        ax.axis("off")
    for rank, (position, score) in enumerate(hits, start=1):
        right.text(0, 1 - (rank - 0.5) / len(hits),
                   textwrap.fill(f"{rank}. {score:.3f}  {captions[position]}", CAPTION_LINE,
                                 subsequent_indent="    ", max_lines=2, placeholder=" ..."),
                   fontsize=8, va="center", transform=right.transAxes)
    return fig


def print_hits(title: str, hits: list[tuple[int, float]], names: list) -> None:
    print(title)
    for rank, (position, score) in enumerate(hits, start=1):
        print(f"{rank:4d}  {score:.6f}  {names[position]}")


def rank_images(retriever: Retriever, queries: list[str], top_k: int, rerank_k: int,
                shards: list[str], image_files: list[str], plt):
    """Print every query's top images; return their contact sheet when drawing (``plt``)."""
    gallery = image_gallery(retriever, shards, image_files, rerank_k)
    hits = retriever.search(queries, gallery.index, top_k, rerank_k)
    for query, row in zip(queries, hits):
        print_hits(f"query: {query}", row, gallery.names)
    if plt is None:
        return None
    pictures = gallery.pictures(sorted({p for row in hits for p, _ in row}))
    return draw_image_hits(plt, queries, hits, pictures, gallery.labels())


def rank_captions(retriever: Retriever, image: str, top_k: int, rerank_k: int,
                  captions: list[str], plt):
    """Print the image's top captions; return the picture of them when drawing (``plt``)."""
    hits = retriever.search([image], encoded_index(retriever, captions, "texts"), top_k,
                            rerank_k)[0]
    print_hits(f"image: {image}", hits, captions)
    if plt is None:
        return None
    from mmgoal.api import rgb_image

    return draw_caption_hits(plt, rgb_image(image), Path(image).name, hits, captions)


def search(args: argparse.Namespace) -> int:
    import mmgoal
    from mmgoal.data.pipeline import read_captions

    if args.image is not None and not Path(args.image).is_file():
        raise FileNotFoundError(f"--image {args.image} does not exist")
    if args.texts and args.query:
        raise ValueError("--texts holds the captions --image ranks; --query ranks --images")
    if args.texts and args.images:
        raise ValueError("--image ranks the captions of --images or of --texts; give one")
    if not args.images and not args.texts:
        raise ValueError("give the gallery: --images shards or image files"
                         + ("" if args.query else ", or --texts with captions"))
    shards, image_files = gallery_files(args.images) if args.images else ([], [])
    if args.image is not None and image_files:
        raise ValueError("--image ranks captions, and image files have none: give shards "
                         "with --images or a caption file with --texts")
    texts = read_texts(args.texts) if args.texts else None
    plt = pyplot("mmgoal search --out") if args.out else None
    retriever = mmgoal.load(args.run, device=args.device, batch_size=args.batch_size,
                            trust_custom_imports=args.trust_custom_imports)
    rerank_k = retriever.scoring.rerank_k if args.rerank_k is None else args.rerank_k
    if args.query:
        fig = rank_images(retriever, args.query, args.top_k, rerank_k, shards, image_files, plt)
    else:  # the shards' captions, a caption of several images once
        captions = texts or list(dict.fromkeys(read_captions(shards)))
        if not captions:
            raise ValueError(f"the shards hold no captions for --image to rank "
                             f"({', '.join(shards)}); give them with --texts FILE, one a line")
        fig = rank_captions(retriever, args.image, args.top_k, rerank_k, captions, plt)
    if fig is not None:
        save_figure(fig, args.out, dpi=DPI)
        plt.close(fig)
        print(f"written to {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = tool_parser(__doc__)
    parser.add_argument("run", help="a run directory (its checkpoints/best.pt), a checkpoint or an "
                                     "export (mmgoal export)")
    query = parser.add_mutually_exclusive_group(required=True)
    query.add_argument("--query", action="append", metavar="TEXT",
                       help="a caption to rank the images for (repeat for several)")
    query.add_argument("--image", metavar="FILE", help="an image to rank the captions for")
    parser.add_argument("--images", nargs="+", metavar="PATTERN",
                        help="the gallery: shards ('test-{000000..000004}.tar', "
                             "'test-*.tar'), or image files and folders of them")
    parser.add_argument("--texts", metavar="FILE",
                        help="with --image: captions to rank, one per line (instead of "
                             "the captions of the --images shards)")
    parser.add_argument("--top-k", type=positive_int, default=8, help="hits per query")
    parser.add_argument("--rerank-k", type=int, default=None,
                        help="re-rank the top K of every query by ITM (cross encoders; 0 = "
                             "off; default: evaluation.rerank_k of the model's config)")
    parser.add_argument("--out", help="PNG of the hits (needs the plot extra)")
    add_device_option(parser)
    parser.add_argument("--batch-size", type=positive_int, default=64,
                        help="images or captions encoded at a time")
    add_loading_options(parser)
    args = parser.parse_args(argv)
    apply_loading_options(args)
    try:
        return search(args)
    except INPUT_ERRORS as error:
        return print_error(error)


if __name__ == "__main__":
    sys.exit(main())
