"""The monkeypatches of vLLM internals, filed by vLLM area, each bound to its register entry;
version-fenced and idempotent.

vLLM has no hook for a new speculative method, for tree verification or for KV compaction, so
DDTree wraps these methods. Each wrapper falls through to vLLM's original unchanged unless DDTree
is configured for the engine (``additional_config["ddtree"]``), so plain vLLM use in the same
process is untouched. The areas (each target's why and expected signature per vLLM version are
its entry in :data:`vllm_ddtree.integration.REGISTER`):

* :mod:`.frontend` (the process that builds the config and accepts requests):
  ``EngineArgs.create_speculative_config`` (``{"method": "ddtree", ...}`` -> vLLM's ``dflash``
  config + ``additional_config["ddtree"]``), ``EngineArgs.create_engine_config`` (tree-attention
  backend, start-up refusals), ``InputProcessor._validate_params`` (request refusals; min-p let
  through). Can go when vLLM accepts plugin speculative methods and tree verification.
* :mod:`.stats`: ``Scheduler.make_spec_decoding_stats``, ``Scheduler.update_from_output``,
  ``Worker.sample_tokens``, ``PrometheusStatLogger.__init__``: spec-decode counters per tree
  depth, sized by the drafter horizon L, and the drafter's figures (:mod:`vllm_ddtree.metrics`).
  Can go when vLLM's spec-decode metrics know trees.
* :mod:`.v2` (Model Runner V2, the primary runner): ``init_speculator``,
  ``resolve_model_state_cls``, ``GPUModelRunner.initialize_kv_cache``: V2's factory seams return
  :mod:`vllm_ddtree.runners.v2`'s classes. Can go when V2 selects speculators by plugin.
* :mod:`.hybrid`: vLLM's recurrent kernels (CPU and CUDA) and state shapes, stepped over the
  tree as the sequential oracle (:mod:`vllm_ddtree.hybrid`). Can go when vLLM's recurrent layers
  take a tree.
* Model Runner V1 (vLLM 0.32/0.33): the legacy adapter's hooks,
  :mod:`vllm_ddtree.runners.v1.hooks`, loaded here only where vLLM has V1. Go with 0.32/0.33.

:func:`apply_patches` is called by the plugin in every process; it first checks the whole register
against the installed vLLM (:func:`vllm_ddtree.integration.verify_installed`: a supported version,
every target present with the recorded signature) and patches nothing otherwise, in which case the
plugin installs only :func:`apply_version_guard` so that a ``ddtree`` request fails with that
error.
"""

from __future__ import annotations

import functools
import importlib
import logging
from typing import Any, Callable


from vllm_ddtree import integration
# Re-exported: the version fence lives with the register.
from vllm_ddtree.integration import (  # noqa: F401
    UnsupportedVLLMVersion,
    check_vllm_version,
    installed_vllm_version,
)

# A child of vLLM's logger, so our messages use vLLM's handlers and VLLM_LOGGING_LEVEL.
logger = logging.getLogger("vllm.ddtree")

_MARK = "__vllm_ddtree_patch__"


def patch(
    module: str, qualname: str, cpu_only: bool = False, *, why: str | None = None,
    signatures: dict[str, str | None] | None = None,
) -> Callable[[Callable[[Callable], Callable]], Callable]:
    """Bind ``make_wrapper(original) -> wrapper`` for ``module.qualname`` (``Class.method``) to
    its register entry; :func:`apply_patches` installs it.

    ``cpu_only`` patches are installed on the CPU platform only (they wrap CPU kernels). A
    target not yet listed in :data:`vllm_ddtree.integration.REGISTER` gets an entry from
    ``why`` and ``signatures`` (supported vLLM version -> expected signature); without them
    the install check fails naming the target (see
    :func:`vllm_ddtree.integration.bind_patch`).

    Raises:
        KeyError: the target is registered with another kind.
        ValueError: ``cpu_only`` disagrees with the entry, the target is patched twice, or it
            is declared twice.
    """

    def deco(make_wrapper: Callable[[Callable], Callable]) -> Callable:
        integration.bind_patch(module, qualname, make_wrapper, cpu_only, why=why,
                               signatures=signatures)
        return make_wrapper

    return deco


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _install(module: str, qualname: str, make_wrapper: Callable[[Callable], Callable]) -> bool:
    owner: Any = importlib.import_module(module)
    *path, attr = qualname.split(".")
    for p in path:
        owner = getattr(owner, p)
    original = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr)
    if original is None:
        raise UnsupportedVLLMVersion(f"vLLM has no {module}.{qualname} to patch")
    bound = isinstance(original, classmethod)  # wrapped as the function, re-bound after
    func = original.__func__ if bound else original
    if getattr(func, _MARK, False):
        return False  # idempotent: already ours
    wrapper = make_wrapper(func)
    functools.update_wrapper(wrapper, func)
    setattr(wrapper, _MARK, True)
    setattr(owner, attr, classmethod(wrapper) if bound else wrapper)
    return True


def apply_patches() -> int:
    """Check the register against the installed vLLM, then install every bound patch once per
    process; returns how many were new.

    Raises:
        UnsupportedVLLMVersion: the installed vLLM is not a supported version, a register
            entry is missing or has another signature, or the vLLM has Model Runner V1 and the
            legacy V1 adapter is not in the package (nothing is patched then).
        KeyError: a ``"patch"`` entry of the register has no wrapper bound.
    """
    integration.verify_installed()
    platform = "cpu" if _on_cpu() else "cuda"
    version = integration.installed_vllm_version()
    if _HAS_V1 and _V1_HOOKS is None:  # V1 would run vLLM's plain DFlash: refuse, never guess
        raise UnsupportedVLLMVersion(
            f"vLLM {version} has Model Runner V1, but this vllm-ddtree build has no V1 adapter "
            f"(vllm_ddtree/runners/v1/ was removed); install vLLM 0.34 or later")
    count = 0
    for change in integration.entries("patch"):
        if platform not in change.platforms or not change.present(version, platform):
            continue  # another platform's, or gone in this vLLM (V1's in 0.34)
        if change.make_wrapper is None:
            raise KeyError(f"register entry {change.target} has no patch bound to it")
        count += _install(change.module, change.qualname, change.make_wrapper)
    return count


def apply_version_guard(error: UnsupportedVLLMVersion) -> bool:
    """When the plugin cannot install: only make a ``ddtree`` request fail, with ``error``
    (plain vLLM use stays untouched). Returns whether the guard was newly installed."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_ddtree.patches.frontend import wants_ddtree

    original = EngineArgs.__dict__["create_speculative_config"]
    if getattr(original, _MARK, False):
        return False

    def create_speculative_config(self, *args, **kwargs):
        if wants_ddtree(self):
            raise UnsupportedVLLMVersion(str(error))
        return original(self, *args, **kwargs)

    functools.update_wrapper(create_speculative_config, original)
    setattr(create_speculative_config, _MARK, True)
    EngineArgs.create_speculative_config = create_speculative_config
    return True


# --------------------------------------------------------------------------- the areas
# Each area's patches bind themselves to the register on import. Model Runner V1's (the legacy
# adapter's hooks) only where vLLM still has V1 (0.32/0.33), so that nothing of V1 is loaded on 0.34.
from vllm_ddtree.patches import frontend, hybrid, stats, v2  # noqa: E402,F401

_HAS_V1 = installed_vllm_version() in integration.LEGACY_V1_VERSIONS
#: The legacy adapter's hooks, where vLLM has V1; ``None`` there if the adapter was deleted.
_V1_HOOKS = integration.legacy_v1("hooks") if _HAS_V1 else None
