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
    """Check the vLLM version, register the tree-attention backend and model classes, patch.

    On a vLLM version this plugin was not built for nothing is patched or registered; only a
    guard is installed so that ``"method": "ddtree"`` fails with an error naming both versions.
    """
    global _registered
    if _registered:
        return
    from vllm_ddtree import patches

    try:
        patches.check_vllm_version()
    except patches.UnsupportedVLLMVersion as e:
        logger.error("%s", e)
        patches.apply_version_guard()
        _registered = True
        return

    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    # Both overrides behave exactly as vLLM's backend outside DDTree engines.
    if current_platform.is_cpu():
        register_backend(AttentionBackendEnum.CPU_ATTN, CPU_BACKEND)
    elif current_platform.is_cuda():
        register_backend(AttentionBackendEnum.TRITON_ATTN, CUDA_BACKEND)
    patches.apply_patches()
    # GraniteMoeHybrid with the EAGLE3 aux-hidden-state interface DFlash needs (vLLM's lacks it).
    from vllm_ddtree.models import register_models

    register_models()
    _registered = True
