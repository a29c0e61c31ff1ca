"""Image and text encoders."""

from mmgoal.models.encoders import gru_text, hf_text, regions, small_cnn, timm_image  # noqa: F401
