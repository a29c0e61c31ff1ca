"""Strategies: how a run uses its processes (registered in ``STRATEGIES``)."""
