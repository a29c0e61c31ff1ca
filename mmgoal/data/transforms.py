"""Image transforms, built from config lists of ``{type: ..., kwargs}``: the torchvision
transforms below under their own names (the synthetic benchmark's configs leave out flips
and crops: its captions name left, right and positions) and ``TimmTransform``, a pretrained
timm model's preprocessing; open_clip's and Hugging Face's are in :mod:`mmgoal.models.clip`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torchvision import transforms as T

from mmgoal.registry import TRANSFORMS

for _cls in (T.Resize, T.CenterCrop, T.RandomResizedCrop, T.RandomHorizontalFlip,
             T.ColorJitter, T.ToTensor, T.Normalize, T.RandomErasing):
    TRANSFORMS.register()(_cls)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
DEFAULT_IMAGE_SIZE = 64  # data.image_size when neither the config nor the model sets it


def default_transforms(image_size: int | None) -> list[dict]:
    """The default pipeline: resize to ``image_size`` squared (64 when ``None``), convert
    to a tensor, normalise with the ImageNet statistics."""
    size = DEFAULT_IMAGE_SIZE if image_size is None else image_size
    return [{"type": "Resize", "size": [size, size]}, {"type": "ToTensor"},
            {"type": "Normalize", "mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD)}]


def build_transforms(cfgs: Sequence[dict] | None, image_size: int | None) -> T.Compose:
    """A ``Compose`` of the configured transforms; ``None`` gives :func:`default_transforms`."""
    if cfgs is None:
        cfgs = default_transforms(image_size)
    return T.Compose([TRANSFORMS.build(cfg) for cfg in cfgs])


@TRANSFORMS.register(name="TimmTransform")
def timm_transform(model_name: str, image_size: int | None = None) -> Callable:
    """timm's eval preprocessing of a pretrained model: resize, centre crop, mean and std
    of its pretrained config (``timm.data.resolve_data_config``, then ``create_transform``).

    ``model_name.tag`` picks one of its tags' configs; ``image_size``: the crop's side
    (default: the model's input size), the resize before it keeping the model's crop ratio.
    """
    from timm.data import create_transform, resolve_data_config
    from timm.models import get_pretrained_cfg

    pretrained_cfg = get_pretrained_cfg(model_name)
    if pretrained_cfg is None:
        raise ValueError(f"TimmTransform: timm has no pretrained config for {model_name!r} "
                         f"(its mean/std and crop); give the transforms in data.train_transforms "
                         f"/ data.eval_transforms instead")
    size = {} if image_size is None else {"input_size": (3, image_size, image_size)}
    data_config = resolve_data_config(size, pretrained_cfg=pretrained_cfg.to_dict())
    return create_transform(**data_config, is_training=False)
