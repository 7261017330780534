"""Hybrid-target patches: vLLM's recurrent kernels (CPU and CUDA) and state shapes, stepped over
the draft tree as the sequential oracle (:mod:`vllm_ddtree.hybrid`)."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable, Iterator

import torch

from vllm_ddtree import integration
from vllm_ddtree.config import get_ddtree_config
from vllm_ddtree.patches import patch


@patch("vllm.model_executor.layers.mamba.ops.cpu.gdn_attention", "_spec_forward", cpu_only=True)
def _gdn_spec_forward(original: Callable) -> Callable:
    def _spec_forward(layer, attn_metadata_i, mixed_qkv_spec, b_spec, a_spec, conv_buf,
                      ssm_state, width, state_len):
        from vllm_ddtree.hybrid.context import active_hybrid_context

        ctx = active_hybrid_context()
        if ctx is None:
            return original(layer, attn_metadata_i, mixed_qkv_spec, b_spec, a_spec, conv_buf,
                            ssm_state, width, state_len)
        from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

        from vllm_ddtree.hybrid.gdn_cpu import tree_spec_forward

        return tree_spec_forward(ctx, layer, attn_metadata_i, mixed_qkv_spec, b_spec, a_spec,
                                 conv_buf, ssm_state, width,
                                 gdn_attention._unpacked_conv_weight(layer))

    return _spec_forward


#: While vLLM sizes a DDTree engine's Mamba page from the model config (before the layers
#: exist; the layers' own windows are set by ``hybrid.guard.fit_recurrent_state_shapes``): the
#: speculative tokens its conv windows hold (``DDTreeConfig.num_recurrent_state_blocks``).
_CONV_SPEC_TOKENS: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "ddtree_conv_spec_tokens", default=None)


@contextlib.contextmanager
def _recurrent_state_shapes_of(vllm_config: Any) -> Iterator[None]:
    """Within: vLLM's state-shape calculators size conv windows for ``vllm_config``'s DDTree
    engine (``W - 1 + L`` in oracle mode), not for its ``num_speculative_tokens``."""
    ddtree = get_ddtree_config(vllm_config)
    token = _CONV_SPEC_TOKENS.set(None if ddtree is None else ddtree.num_recurrent_state_blocks)
    try:
        yield
    finally:
        _CONV_SPEC_TOKENS.reset(token)


def _conv_spec_tokens(num_spec: int) -> int:
    limit = _CONV_SPEC_TOKENS.get()
    return num_spec if limit is None else min(num_spec, limit)


@patch("vllm.model_executor.layers.mamba.abstract", "MambaBase.get_kv_cache_spec")
def _recurrent_state_blocks(original: Callable) -> Callable:
    def get_kv_cache_spec(self, vllm_config):
        spec = original(self, vllm_config)
        ddtree = get_ddtree_config(vllm_config)
        blocks = getattr(spec, "num_speculative_blocks", None)
        if ddtree is None or blocks is None or blocks <= ddtree.num_recurrent_state_blocks:
            return spec
        return dataclasses.replace(spec, num_speculative_blocks=ddtree.num_recurrent_state_blocks)

    return get_kv_cache_spec


@patch("vllm.platforms.interface", "Platform._align_hybrid_block_size")
def _hybrid_page_size(original: Callable) -> Callable:
    def _align_hybrid_block_size(cls, vllm_config, backend_cls):
        with _recurrent_state_shapes_of(vllm_config):  # the Mamba page of W - 1 + L windows
            return original(cls, vllm_config, backend_cls)

    return _align_hybrid_block_size


_SHAPES = "vllm.model_executor.layers.mamba.mamba_utils"


@patch(_SHAPES, "MambaStateShapeCalculator.gated_delta_net_state_shape")
def _gdn_state_shape(original: Callable) -> Callable:
    def gated_delta_net_state_shape(cls, tp_world_size, num_k_heads, num_v_heads, head_k_dim,
                                    head_v_dim, conv_kernel_size, num_spec=0):
        return original(cls, tp_world_size, num_k_heads, num_v_heads, head_k_dim, head_v_dim,
                        conv_kernel_size, _conv_spec_tokens(num_spec))

    return gated_delta_net_state_shape


@patch(_SHAPES, "MambaStateShapeCalculator.mamba2_state_shape")
def _mamba2_state_shape(original: Callable) -> Callable:
    def mamba2_state_shape(cls, tp_world_size, intermediate_size, n_groups, num_heads, head_dim,
                           state_size, conv_kernel, num_spec=0):
        return original(cls, tp_world_size, intermediate_size, n_groups, num_heads, head_dim,
                        state_size, conv_kernel, _conv_spec_tokens(num_spec))

    return mamba2_state_shape


@patch("vllm.v1.attention.backends.mamba_attn",
       "BaseMambaAttentionMetadataBuilder._compute_common_metadata")
def _padded_prompt_rows(original: Callable) -> Callable:
    def _compute_common_metadata(self, common_attn_metadata, *, num_accepted_tokens=None,
                                 num_decode_draft_tokens_cpu=None):
        m = common_attn_metadata
        if (num_decode_draft_tokens_cpu is not None and m.is_prefilling is not None
                and _oracle_engine(self.vllm_config)):
            # vLLM's scheduler pads a one-token prompt with placeholder drafts; vLLM sends such
            # a row to its prefill kernels when the request is new, which fold the placeholders
            # into the state. As a speculative row it goes through the tree oracle (from a zero
            # state, HybridTreeContext.fresh_rows) and only the accepted path is committed.
            query_lens = torch.diff(m.query_start_loc_cpu)
            n = min(len(query_lens), len(num_decode_draft_tokens_cpu), len(m.is_prefilling))
            padded = torch.zeros_like(m.is_prefilling)
            drafts = num_decode_draft_tokens_cpu[:n]
            padded[:n] = (m.is_prefilling[:n] & (drafts > 0) & (query_lens[:n] == drafts + 1)
                          & (m.seq_lens_cpu_upper_bound[:n] <= query_lens[:n]))
            if bool(padded.any()):
                m = m.replace(is_prefilling=m.is_prefilling & ~padded)
        return original(self, m, num_accepted_tokens=num_accepted_tokens,
                        num_decode_draft_tokens_cpu=num_decode_draft_tokens_cpu)

    return _compute_common_metadata


def _oracle_engine(vllm_config: Any) -> bool:
    ddtree = get_ddtree_config(vllm_config)
    return ddtree is not None and ddtree.hybrid == "oracle"


@contextlib.contextmanager
def _target_only_conv_choice() -> Iterator[None]:
    """Make vLLM's speculative-aware CPU GDN prefill pick the conv kernel target-only picks.

    vLLM's non-speculative CPU GDN path runs the C++ causal conv wherever the CPU has BF16 dot
    products (``_cpu_gdn_attention_nonspec``: ``use_cpp_conv``); its speculative-aware path asks
    for AMX tiles instead (``_spec_aware_nonspec``: ``can_use_native_conv``) and otherwise falls
    back to a torch conv whose bf16 rounding differs, so a DDTree prefill would not match
    target-only decoding bit for bit. Both call the same C++ kernel, which handles the wide
    speculative conv buffer; only the predicate is aligned, and only for steps without
    speculative rows: in a step that mixes prefills with speculative rows
    (``_spec_aware_nonspec_subset``) the C++ path gives wrong prefill outputs here, so vLLM's
    torch conv stays (equal up to bf16 rounding).
    """
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

    if not (torch.cpu._is_avx512_bf16_supported() or gdn_attention.is_arm_bf16()):
        yield
        return
    with integration.swapped("torch.cpu", "_is_amx_tile_supported", lambda: True):
        yield


def _gdn_prefill(original: Callable) -> Callable:
    def wrapper(*args, **kwargs):
        from vllm_ddtree.hybrid.context import active_hybrid_context

        if active_hybrid_context() is None:
            return original(*args, **kwargs)
        with _target_only_conv_choice():
            return original(*args, **kwargs)

    return wrapper


patch("vllm.model_executor.layers.mamba.ops.cpu.gdn_attention", "_spec_aware_nonspec",
      cpu_only=True)(_gdn_prefill)


_MIXER2 = "vllm.model_executor.layers.mamba.mamba_mixer2"


@patch(_MIXER2, "causal_conv1d_update")
def _mamba2_conv_update(original: Callable) -> Callable:
    def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, *args, **kwargs):
        from vllm_ddtree.hybrid.context import active_hybrid_context
        from vllm_ddtree.hybrid.mamba2 import is_speculative_call, tree_conv_update

        ctx = active_hybrid_context()
        indices = kwargs.get("conv_state_indices")
        if ctx is None or args or not is_speculative_call(indices):
            return original(x, conv_state, weight, bias, activation, *args, **kwargs)
        return tree_conv_update(ctx, original, x, conv_state, weight, bias, activation, indices,
                                kwargs["num_accepted_tokens"], kwargs["query_start_loc"])

    return causal_conv1d_update


@patch(_MIXER2, "selective_state_update")
def _mamba2_state_update(original: Callable) -> Callable:
    def selective_state_update(state, x, dt, A, B, C, D=None, dt_bias=None, *args, **kwargs):
        from vllm_ddtree.hybrid.context import active_hybrid_context
        from vllm_ddtree.hybrid.mamba2 import is_speculative_call, tree_state_update

        ctx = active_hybrid_context()
        indices = kwargs.get("state_batch_indices")
        if ctx is None or args or not is_speculative_call(indices) or kwargs.get("z") is not None:
            return original(state, x, dt, A, B, C, D, dt_bias, *args, **kwargs)
        kw = dict(kwargs)
        for k in ("state_batch_indices", "dst_state_batch_indices", "out", "num_accepted_tokens",
                  "cu_seqlens", "dt_softplus", "z"):
            kw.pop(k, None)
        return tree_state_update(ctx, original, state, x, dt, A, B, C, D, dt_bias,
                                 kwargs.get("dt_softplus", False), indices, kwargs["out"],
                                 kwargs["num_accepted_tokens"], kwargs["cu_seqlens"], **kw)

    return selective_state_update


# GatedDeltaNet on CUDA (``QwenGatedDeltaNetAttention.forward_cuda``): the core publishes its
# layer for the two Triton kernels it calls on speculative rows, and vLLM's fused MTP op (which
# would run those rows as a chain inside one CUDA op) is never chosen during a DDTree step.

_QWEN_GDN = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"


@patch(_QWEN_GDN, "QwenGatedDeltaNetAttention._forward_core")
def _gdn_forward_core(original: Callable) -> Callable:
    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        from vllm_ddtree.hybrid.context import active_hybrid_context
        from vllm_ddtree.hybrid.gdn_cuda import gdn_layer_call

        ctx = active_hybrid_context()
        if ctx is None:
            return original(self, mixed_qkv, b, a, core_attn_out)
        with gdn_layer_call(ctx, self):
            return original(self, mixed_qkv, b, a, core_attn_out)

    return _forward_core


@patch(_QWEN_GDN, "QwenGatedDeltaNetAttention._can_use_fused_gdn_mtp_decode")
def _gdn_no_fused_mtp(original: Callable) -> Callable:
    def _can_use_fused_gdn_mtp_decode(self, attn_metadata):
        from vllm_ddtree.hybrid.context import active_hybrid_context

        if active_hybrid_context() is not None:
            return False
        return original(self, attn_metadata)

    return _can_use_fused_gdn_mtp_decode


@patch(_QWEN_GDN, "causal_conv1d_update")
def _gdn_conv_update(original: Callable) -> Callable:
    def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, *args, **kwargs):
        from vllm_ddtree.hybrid.context import active_hybrid_context
        from vllm_ddtree.hybrid.gdn_cuda import is_speculative_call, tree_conv_update

        ctx = active_hybrid_context()
        if (ctx is None or ctx.gdn_call is None or args
                or not is_speculative_call(kwargs.get("num_accepted_tokens"))):
            return original(x, conv_state, weight, bias, activation, *args, **kwargs)
        return tree_conv_update(ctx, original, x, conv_state, weight, bias, activation)

    return causal_conv1d_update


@patch(_QWEN_GDN, "fused_sigmoid_gating_delta_rule_update")
def _gdn_recurrent_update(original: Callable) -> Callable:
    def fused_sigmoid_gating_delta_rule_update(*args, **kwargs):
        from vllm_ddtree.hybrid.context import active_hybrid_context
        from vllm_ddtree.hybrid.gdn_cuda import is_speculative_call, tree_gated_delta_update

        ctx = active_hybrid_context()
        if (ctx is None or ctx.gdn_call is None or args
                or not is_speculative_call(kwargs.get("num_accepted_tokens"))):
            return original(*args, **kwargs)
        return tree_gated_delta_update(ctx, original, **kwargs)

    return fused_sigmoid_gating_delta_rule_update
