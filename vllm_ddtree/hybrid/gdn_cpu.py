"""GatedDeltaNet (Qwen3-Next, Qwen3.5) speculative rows through the tree oracle, on CPU vLLM.

Replaces the body of vLLM's ``_spec_forward`` (``vllm/model_executor/layers/mamba/ops/cpu/
gdn_attention.py``) while a DDTree hybrid step is active: the conv runs over each node's
ancestor window, and the recurrence runs one depth level at a time through vLLM's own one-token
decode kernel (``ops.fused_sigmoid_gating_delta_rule_update_cpu``, the kernel target-only
decoding uses), each node starting from its parent's state in the oracle's level scratch; the
accepted path is replayed into vLLM's state block after verification
(:mod:`vllm_ddtree.hybrid.oracle`). Prefill rows stay vLLM's.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_ddtree.hybrid.context import HybridTreeContext, RecurrentRecord
from vllm_ddtree.hybrid.oracle import (
    RecurrentTreeLayout,
    gather_conv_windows,
    load_committed,
    read_conv_windows,
    run_tree_levels,
)


def spec_batch_rows(spec_sequence_masks: torch.Tensor | None, num_spec: int) -> list[int]:
    """Input-batch rows of the speculative sequences, in the order vLLM packs them."""
    if spec_sequence_masks is None:
        return list(range(num_spec))
    return torch.nonzero(spec_sequence_masks.cpu()).flatten()[:num_spec].tolist()


def gdn_layout(ctx: HybridTreeContext, md: Any,
               width: int | None) -> tuple[RecurrentTreeLayout, torch.Tensor | None]:
    """The speculative rows' layout of one ``GDNAttentionMetadata`` (``md``), memoised per
    step; with ``width``, also the conv window index for that conv width."""
    def build():
        n_spec = md.num_spec_decodes
        qsl = md.spec_query_start_loc[: n_spec + 1].cpu()
        return ((qsl[1:] - qsl[:-1]).tolist(), spec_batch_rows(md.spec_sequence_masks, n_spec),
                md.spec_state_indices_tensor[:n_spec], md.num_accepted_tokens[:n_spec])

    return ctx.layout(("gdn", id(md)), build, width, keep=md)


def decode_conv(layer: Any, x: torch.Tensor, windows: torch.Tensor,
                unpacked_conv_weight: torch.Tensor) -> torch.Tensor:
    """Each token's conv output through the kernel target-only decoding uses for it.

    Mirrors the decode branch of ``_cpu_gdn_attention_nonspec`` (vLLM's non-speculative CPU GDN
    path): the C++ ``causal_conv1d_update_cpu`` on packed weights where the CPU has BF16 dot
    products, else vLLM's torch update; each token gets a scratch conv state holding its
    ancestor window, so the arithmetic is the same as one plain decode step.

    Args:
        x: ``[T, dim]`` bf16; windows: ``[T, dim, W - 1]`` (from ``gather_conv_windows``);
        unpacked_conv_weight: ``[dim, W]``.

    Returns:
        ``[T, dim]`` conv outputs (SiLU applied when the layer's activation is SiLU).
    """
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as G
    from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import causal_conv1d_update_cpu

    T, dim, m = windows.shape
    if T == 0:
        return x.clone()
    # Row 0 of the scratch state stays unused: slot 0 is vLLM's null block (skipped).
    indices = torch.arange(1, T + 1, dtype=torch.int32, device=x.device)
    x = x.contiguous()
    if torch.cpu._is_avx512_bf16_supported() or G.is_arm_bf16():
        if is_conv_state_dim_first():
            scratch = torch.zeros(T + 1, dim, m, dtype=windows.dtype, device=x.device)
        else:  # the SD cache (slots, W - 1, dim) as the (slots, dim, W - 1) view vLLM passes
            scratch = torch.zeros(T + 1, m, dim, dtype=windows.dtype, device=x.device).transpose(1, 2)
        scratch[1:] = windows
        return G._causal_conv1d_update_cpu(
            x=x, conv_states=scratch, weight=layer.conv1d.weight, bias=layer.conv1d.bias,
            silu_activation=(layer.activation == "silu"), conv_state_indices=indices,
            is_weight_packed=True,
        )
    scratch = torch.cat([torch.zeros_like(windows[:1]), windows]).contiguous()
    return causal_conv1d_update_cpu(
        x=x, conv_state=scratch, weight=unpacked_conv_weight, bias=layer.conv1d.bias,
        activation=layer.activation, conv_state_indices=indices,
    )


def tree_spec_forward(
    ctx: HybridTreeContext,
    layer: Any,
    attn_metadata_i: Any,
    mixed_qkv_spec: torch.Tensor,
    b_spec: torch.Tensor,
    a_spec: torch.Tensor,
    conv_buf: torch.Tensor,
    ssm_state: torch.Tensor,
    width: int,
    unpacked_conv_weight: torch.Tensor,
) -> torch.Tensor:
    """GDN core output of the speculative rows, every node from its parent's state.

    Args:
        layer: vLLM's GDN layer (``A_log``, ``dt_bias``, ``conv1d``, ``activation``,
            ``rearrange_mixed_qkv``).
        attn_metadata_i: the layer's ``GDNAttentionMetadata``.
        mixed_qkv_spec: ``[T, dim]`` bf16 pre-conv q/k/v of the speculative rows (spec order).
        b_spec, a_spec: ``[T, H_v]`` gate inputs.
        conv_buf: ``[slots, dim, W - 1 + K]`` conv cache view; ssm_state: ``[slots, H_v, K, V]``.
        unpacked_conv_weight: ``[dim, W]`` plain conv weight.

    Returns:
        ``[T, H_v, V]`` core attention output in spec order (what ``_spec_forward`` returns).
    """
    layout, index = gdn_layout(ctx, attn_metadata_i, width)

    prior = read_conv_windows(conv_buf, layout, width)
    windows = gather_conv_windows(mixed_qkv_spec, prior, index)
    conv_inputs = mixed_qkv_spec.clone()  # kept for the commit after verification
    conv_out = decode_conv(layer, mixed_qkv_spec, windows, unpacked_conv_weight)

    from vllm_ddtree.integration import cpu_ops

    ops = cpu_ops()

    query, key, value = layer.rearrange_mixed_qkv(conv_out)  # each [1, T, heads, dim]
    a_spec, b_spec = a_spec.clone(), b_spec.clone()  # kept for the replay after verification
    T = mixed_qkv_spec.shape[0]
    out = torch.empty(T, value.shape[-2], value.shape[-1], dtype=mixed_qkv_spec.dtype,
                      device=mixed_qkv_spec.device)

    def advance(lay: RecurrentTreeLayout, scratch: torch.Tensor,
                out: torch.Tensor | None = None) -> None:
        def step(level: torch.Tensor, dst: torch.Tensor) -> None:
            lv = level.to(query.device)
            n = lv.numel()
            o = ops.fused_sigmoid_gating_delta_rule_update_cpu(
                A_log=layer.A_log,
                dt_bias=layer.dt_bias,
                q=query[:, lv].contiguous(),
                k=key[:, lv].contiguous(),
                v=value[:, lv].contiguous(),
                a=a_spec[lv].contiguous(),
                b=b_spec[lv].contiguous(),
                initial_state_source=scratch,
                initial_state_indices=dst.to(torch.int32),
                cu_seqlens=torch.arange(n + 1, dtype=torch.int32),
                use_qk_l2norm_in_kernel=True,
            )
            if out is not None:
                out[lv] = o.reshape(n, out.shape[1], out.shape[2]).to(out.dtype)

        run_tree_levels(lay, scratch, step)

    scratch = load_committed(layout, ssm_state)
    advance(layout, scratch, out)
    ctx.record(RecurrentRecord(layout, width, conv_buf, prior, conv_inputs, ssm_state, advance),
               scratch)
    return out
