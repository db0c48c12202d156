"""`has_hooks`: whether a fused path that bypasses a module's call would hide it from hooks."""
from torch import nn

__all__ = ["has_hooks"]


def has_hooks(module: nn.Module) -> bool:
    """Whether calling `module` runs forward hooks (its own or global ones): a fused path that
    bypasses the call must not, or the hooks would miss it."""
    return bool(module._forward_hooks or module._forward_pre_hooks
                or nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks)
