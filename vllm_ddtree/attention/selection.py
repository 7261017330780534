"""Which attention backend verifies draft trees, and the start-up errors when the user names another.

vLLM picks an attention backend per platform (``vllm/platforms/cpu.py``, ``cuda.py``:
``get_attn_backend_cls``) unless the user names one (``--attention-backend`` /
``attention_config.backend`` / ``attention_config.backend_per_kind``). DDTree verifies a
different tree per request every step, which only the plugin's backends can do:

* CPU: ``CPU_ATTN`` (overridden by :class:`vllm_ddtree.attention.cpu.DDTreeCPUAttentionBackend`);
* CUDA: ``TRITON_ATTN`` (overridden by :class:`vllm_ddtree.attention.cuda.
  DDTreeTritonAttentionBackend`; vLLM's CUDA default would be FlashAttention or FlashInfer).

:func:`check_tree_attention_backend` runs on the engine arguments before vLLM builds its config
(``EngineArgs.create_engine_config``), so a wrong choice fails at start-up naming the option.
"""

from __future__ import annotations

from typing import Any

from vllm_ddtree.config import DDTreeConfigError

#: Platform -> the backend (``AttentionBackendEnum`` member name) that verifies trees there.
TREE_ATTENTION_BACKENDS = {"cpu": "CPU_ATTN", "cuda": "TRITON_ATTN"}
#: KV-cache dtypes the tree kernels read (quantized caches are refused).
TREE_KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32")


def _name(backend: Any) -> str | None:
    if backend is None:
        return None
    name = getattr(backend, "name", backend)
    return str(name).upper()


def tree_attention_backend(platform: str, named: Any = None,
                           per_kind: dict[str, Any] | None = None,
                           kv_cache_dtype: str = "auto",
                           option: str = "attention_backend") -> str:
    """The backend a DDTree engine must use on ``platform``; refuse any other the user named.

    Pure function (no vLLM import) so that the CUDA rules can be tested on any machine.

    Args:
        platform: ``"cpu"``, ``"cuda"`` or another vLLM device type.
        named: the user's ``attention_backend`` / ``attention_config.backend`` (enum member,
            name string, ``"auto"`` or ``None``).
        per_kind: the user's ``attention_config.backend_per_kind`` (kind -> backend).
        kv_cache_dtype: ``cache_config.cache_dtype`` / ``--kv-cache-dtype``.
        option: how the user named ``named`` (for the error message), e.g.
            ``"attention_config.backend"``.

    Returns:
        The ``AttentionBackendEnum`` member name (``"CPU_ATTN"`` or ``"TRITON_ATTN"``).

    Raises:
        DDTreeConfigError: no tree-attention backend on ``platform``; a named backend (or a
            per-kind override) other than the tree backend; a quantized KV cache.
    """
    required = TREE_ATTENTION_BACKENDS.get(platform)
    if required is None:
        raise DDTreeConfigError(
            f"speculative method 'ddtree' has no tree-attention backend on platform "
            f"{platform!r} (supported: {', '.join(sorted(TREE_ATTENTION_BACKENDS))})"
        )
    user = _name(named)
    if user not in (None, "AUTO", required):
        raise DDTreeConfigError(
            f"{option}={user} cannot verify DDTree draft trees (per-request tree masks); "
            f"on {platform} DDTree uses {required}: leave {option} unset or set it to "
            f"{required}"
        )
    for kind, backend in (per_kind or {}).items():
        if _name(backend) != required:
            raise DDTreeConfigError(
                f"attention_config.backend_per_kind[{kind!r}]={_name(backend)} cannot verify "
                f"DDTree draft trees; on {platform} DDTree uses {required}"
            )
    if str(kv_cache_dtype) not in TREE_KV_CACHE_DTYPES:
        raise DDTreeConfigError(
            f"kv_cache_dtype={kv_cache_dtype!r} is not supported with speculative method 'ddtree' "
            f"(tree attention reads unquantized caches: {', '.join(TREE_KV_CACHE_DTYPES)})"
        )
    return required


def current_platform_name() -> str:
    """``"cpu"``, ``"cuda"`` (NVIDIA) or vLLM's device name of the current platform."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "cpu"
    if current_platform.is_cuda():
        return "cuda"
    return str(getattr(current_platform, "device_name", None) or current_platform.device_type)


def check_tree_attention_backend(engine_args: Any, platform: str) -> str:
    """Apply :func:`tree_attention_backend` to vLLM ``EngineArgs`` and select the backend.

    When the user named none, ``engine_args.attention_config.backend`` is set to the tree
    backend on CUDA (vLLM would pick FlashAttention or FlashInfer there); on CPU vLLM always
    picks ``CPU_ATTN``, so nothing is set.

    Returns:
        The selected backend name.

    Raises:
        DDTreeConfigError: an unknown backend name, or see :func:`tree_attention_backend`.
    """
    from vllm.config import AttentionConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    attention_config = engine_args.attention_config
    if isinstance(attention_config, dict):
        attention_config = engine_args.attention_config = AttentionConfig(**attention_config)
    named, option = engine_args.attention_backend, "attention_backend"
    if named is None:
        named, option = attention_config.backend, "attention_config.backend"
    user = _name(named)
    if user not in (None, "AUTO") and user not in AttentionBackendEnum.__members__:
        raise DDTreeConfigError(f"{option}={named!r} is not an attention backend of vLLM")
    required = tree_attention_backend(
        platform, named, attention_config.backend_per_kind,
        getattr(engine_args, "kv_cache_dtype", "auto"), option,
    )
    if platform != "cpu" and engine_args.attention_backend is None and (
            attention_config.backend is None):
        attention_config.backend = AttentionBackendEnum[required]
    return required
