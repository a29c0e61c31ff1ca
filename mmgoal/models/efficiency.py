"""Memory and speed switches for big recipes: ``model.grad_checkpointing`` and
``train.compile`` (docs/getting_started.md). Compiling is in place (``nn.Module.compile``),
so parameter names and checkpoints do not change.
"""

from __future__ import annotations

from torch import nn


def _switch_on(module: nn.Module) -> bool:
    """Turn on ``module``'s own gradient checkpointing; False when it has none."""
    if getattr(module, "supports_gradient_checkpointing", False):  # Hugging Face
        # Non-reentrant: works with DDP and with inputs that need no gradient.
        if hasattr(module, "activation_checkpointing_enable"):  # transformers >= 5.x
            module.activation_checkpointing_enable(
                activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            module.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        return True
    if callable(getattr(module, "set_grad_checkpointing", None)):  # timm, mmgoal's fusion
        try:
            module.set_grad_checkpointing(True)
        except (AssertionError, NotImplementedError):  # timm models that cannot
            return False
        return True
    return False


def enable_grad_checkpointing(model: nn.Module) -> list[str]:
    """Turn on gradient checkpointing in the outermost parts of ``model`` that support it;
    their names. A ``ValueError`` where no part does."""
    enabled: list[str] = []
    for name, module in model.named_modules():
        if module is model or any(name.startswith(f"{done}.") for done in enabled):
            continue
        if _switch_on(module):
            enabled.append(name)
    if not enabled:
        parts = ", ".join(type(m).__name__ for m in model.children())
        raise ValueError(f"model.grad_checkpointing: no part of {type(model).__name__} ({parts}) "
                         f"supports gradient checkpointing (timm and Hugging Face towers and "
                         f"fusion layers do); remove the key")
    return enabled


def compile_model(model: nn.Module) -> list[str]:
    """Compile every direct part of ``model`` that holds parameters, in place; their names.
    Models are called through ``encode_image``/``encode_text``/``similarity``, not
    ``forward``, so the parts they call are what is compiled."""
    compiled = []
    for name, child in model.named_children():
        if any(True for _ in child.parameters()):
            child.compile()
            compiled.append(name)
    return compiled
