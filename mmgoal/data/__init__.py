"""Shards, synthetic scenes, shard sources, tokenizers and transforms."""

from mmgoal.data import pipeline, shards, sources, synthetic, tokenizers, transforms  # noqa: F401
