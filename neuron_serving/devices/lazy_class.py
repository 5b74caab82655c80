"""Subclasses of vllm-neuron classes, built on first attribute access.

vllm-neuron exists only on Neuron nodes; a module that subclassed its classes at import
would be unimportable everywhere else (CPU nodes, this repository's tests). vLLM finds
our classes by qualified name (``worker_cls``, a platform plugin's return value), i.e.
through ``getattr(module, name)``, which a module ``__getattr__`` can answer lazily.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def named(cls: type, module: str, name: str) -> type:
    """Make a class defined inside a factory resolvable as ``module.name`` (pickling too)."""
    cls.__module__ = module
    cls.__name__ = cls.__qualname__ = name
    return cls


def module_getattr(
    module: str, name: str, base_path: str, make: Callable[[type], type]
) -> Callable[[str], type]:
    """A module ``__getattr__`` answering ``name`` with ``make(base)`` for the class at
    ``base_path``, built once and then cached as ``module.name``."""
    base_module, _, base_name = base_path.rpartition(".")

    def __getattr__(attr: str) -> type:
        if attr != name:
            raise AttributeError(f"module {module!r} has no attribute {attr!r}")
        base = getattr(importlib.import_module(base_module), base_name)
        cls = named(make(base), module, name)
        setattr(sys.modules[module], name, cls)
        return cls

    return __getattr__
