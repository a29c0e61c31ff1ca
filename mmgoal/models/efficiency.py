"""Memory and speed switches for big recipes: gradient checkpointing and ``torch.compile``.

``model.grad_checkpointing: true`` recomputes the towers' activations in the
backward instead of keeping them (timm's ``set_grad_checkpointing``, Hugging
Face's ``gradient_checkpointing_enable``, mmgoal's fusion layers): about a third
more compute for a fraction of the activation memory. ``train.compile: true``
compiles each part of the model with ``torch.compile`` in place
(``nn.Module.compile``), so parameter names and checkpoints do not change.
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
    """Turn on gradient checkpointing in every part of ``model`` that supports it.

    The outermost module that supports it is switched on, not its submodules.

    Returns:
        The names of the modules switched on.

    Raises:
        ValueError: no part of the model supports it.
    """
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
    """Compile every direct part of ``model`` that holds parameters, in place.

    Models are called through ``encode_image``/``encode_text``/``similarity``,
    not ``forward``, so the parts they call (towers, projections, poolers) are
    what is compiled; each compiles at its first call (seconds to minutes).

    Returns:
        The names of the compiled parts.
    """
    compiled = []
    for name, child in model.named_children():
        if any(True for _ in child.parameters()):
            child.compile()
            compiled.append(name)
    return compiled
