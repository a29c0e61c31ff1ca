"""Image and text encoders (registered in ``ENCODERS``: mmgoal/registry.py)."""
