"""Image transforms, built from config lists of ``{type: ..., kwargs}``.

The torchvision transforms below are registered under their own names. Random
flips and crops are registered for users, but the synthetic benchmark's
captions talk about left/right and positions, so its configs leave them out.
"""

from __future__ import annotations

from collections.abc import Sequence

from torchvision import transforms as T

from mmgoal.registry import TRANSFORMS

for _cls in (T.Resize, T.CenterCrop, T.RandomResizedCrop, T.RandomHorizontalFlip,
             T.ColorJitter, T.ToTensor, T.Normalize, T.RandomErasing):
    TRANSFORMS.register()(_cls)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def build_transforms(cfgs: Sequence[dict] | None, image_size: int) -> T.Compose:
    """A ``Compose`` of the configured transforms; ``None`` gives the default.

    The default resizes to ``image_size``, converts to a tensor and normalises
    with the ImageNet statistics.
    """
    if cfgs is None:
        cfgs = [
            {"type": "Resize", "size": [image_size, image_size]},
            {"type": "ToTensor"},
            {"type": "Normalize", "mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD)},
        ]
    return T.Compose([TRANSFORMS.build(cfg) for cfg in cfgs])
