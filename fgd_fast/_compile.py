"""``torch.compiler.disable`` applied at a function's first call, not when its module is imported.

``torch.compiler.disable`` imports ``torch._dynamo`` (about a second, and Triton with it where
Triton is installed); the functions marked here run only in a distributed step, so ``import
fgd_fast`` would pay that for every user. The mark is the same: a compiled step that reaches
one breaks its graph there and runs it eagerly, also where the first call is met while tracing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch


def eager(fn: Callable) -> Callable:
    """``fn`` run outside ``torch.compile``'s graphs (``torch.compiler.disable``), decorated lazily."""
    disabled: list[Callable] = []

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not disabled:
            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args, **kwargs)

    return wrapper
