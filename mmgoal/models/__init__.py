"""Models (one file per family), encoders, layers and pretrained-weight loading.

Its modules are imported where they are used; the registries import the ones that
register components the first time a name is asked for (mmgoal/registry.py).
"""
