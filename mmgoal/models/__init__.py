"""Models (one file per family), encoders, layers and pretrained-weight loading."""

from mmgoal.models import clip, dual_encoder, encoders, layers, pretrained, scan, xvlm  # noqa: F401
