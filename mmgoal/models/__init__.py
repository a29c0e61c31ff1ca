"""Models (one file per family), encoders and layers."""

from mmgoal.models import dual_encoder, encoders  # noqa: F401
