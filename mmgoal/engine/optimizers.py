"""Optimizers, registered under their torch names (``AdamW``, ``Adam``, ``SGD``)."""

import torch

from mmgoal.registry import OPTIMIZERS

for _cls in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD):
    OPTIMIZERS.register()(_cls)
