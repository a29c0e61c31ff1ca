"""Shards, synthetic scenes, tokenizers and transforms."""

from mmgoal.data import pipeline, shards, synthetic, tokenizers, transforms  # noqa: F401
