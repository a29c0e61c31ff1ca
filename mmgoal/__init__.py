"""mmgoal: registry-based, config-driven image-text matching with GOAL gradient objectives.

Importing the package registers every built-in component.
"""

__version__ = "0.1.0"

from mmgoal import data, engine, evaluation, models, objectives  # noqa: E402,F401  (registration)
from mmgoal.api import Retriever, from_config, load  # noqa: E402  (the Python API: mmgoal/api.py)
from mmgoal.objectives import GoalLoss  # noqa: E402  (GOAL in a loop of your own)

__all__ = ["GoalLoss", "Retriever", "from_config", "load"]
