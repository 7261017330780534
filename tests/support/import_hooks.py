"""Test-only: run a function on a module right after it is imported, wherever that happens.

Test hooks for spawned processes (vLLM workers, Ray actors) are installed at interpreter start
(``tests/support/site/sitecustomize.py``), long before vLLM or the plugin are imported, and must
not import them early: vLLM reads environment switches at import time, and the plugin's modules
import vLLM. :func:`after_import` defers the hook to the moment the module has been executed.
"""

from __future__ import annotations

import importlib.abc
import sys
from types import ModuleType
from typing import Callable

__all__ = ["after_import"]


class _AfterImport(importlib.abc.MetaPathFinder):
    """Meta-path finder that wraps the loader of watched modules; finds nothing itself."""

    def __init__(self) -> None:
        self.callbacks: dict[str, list[Callable[[ModuleType], None]]] = {}

    def find_spec(self, name, path, target=None):
        callbacks = self.callbacks.pop(name, None)  # one-shot; also stops self-recursion
        if not callbacks:
            return None
        spec = None
        for finder in sys.meta_path:  # the finders that would have found it (editable, path)
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_call(module: ModuleType, _exec=exec_module) -> None:
            _exec(module)
            for callback in callbacks:
                callback(module)

        spec.loader.exec_module = exec_then_call
        return spec


_FINDER = _AfterImport()


def after_import(name: str, callback: Callable[[ModuleType], None]) -> None:
    """Call ``callback(module)`` once module ``name`` has been executed.

    Args:
        name: the module's full dotted name (e.g. ``"vllm_ddtree.runners.v1.proposer"``).
        callback: called once, with the module; at once if it is already imported.
    """
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    _FINDER.callbacks.setdefault(name, []).append(callback)
