"""Evaluation: retrieval metrics and gallery scoring."""

from mmgoal.evaluation.retrieval import retrieval_metrics

__all__ = ["retrieval_metrics"]
