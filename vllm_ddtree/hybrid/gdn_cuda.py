"""GatedDeltaNet (Qwen3-Next, Qwen3.5 / 3.6) speculative rows through the tree oracle, on CUDA.

vLLM's CUDA GDN core (``QwenGatedDeltaNetAttention._forward_core`` in
``vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py``) runs the speculative rows of a
step through two module-level Triton ops: ``causal_conv1d_update`` (spec mode:
``num_accepted_tokens`` and ``query_start_loc`` given) and
``fused_sigmoid_gating_delta_rule_update`` (spec mode: ``[N, K + 1]`` ``ssm_state_indices`` and
``num_accepted_tokens``), which advance one state along each request's rows as a chain. While a
DDTree hybrid step is active, those two calls are replaced here by the sequential tree oracle,
made of the same kernels' one-token calls:

* conv: every node's window is its ancestor path (continuing the committed window), and one
  call of vLLM's conv update runs all nodes as one-token decode rows;
* recurrence: one batched call of vLLM's fused GDN update per tree depth, one token per node,
  in the oracle's level scratch (:mod:`vllm_ddtree.hybrid.oracle`). Each node's row gets state
  indices ``[node row, parent row]`` and ``num_accepted_tokens = 2``: the kernel's own
  spec-decode addressing then reads the state before the token from the parent's row (column
  ``num_accepted - 1``) and writes the state after it to the node's row (column ``0``), so no
  state is copied. After verification the same calls replay the accepted path into vLLM's
  state block (:meth:`~vllm_ddtree.hybrid.context.RecurrentRecord.commit`).

Prefill rows, non-speculative decode rows and every other engine stay vLLM's. The rows' outputs
and the re-layout after verification are those of the CPU path (:mod:`.gdn_cpu`); the layout
(:class:`~vllm_ddtree.hybrid.oracle.RecurrentTreeLayout`) is shared by all GDN layers of a step.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from vllm_ddtree.hybrid.context import HybridTreeContext, RecurrentRecord
from vllm_ddtree.hybrid.gdn_cpu import gdn_layout
from vllm_ddtree.hybrid.oracle import (
    RecurrentTreeLayout,
    conv_through_kernel,
    gather_conv_windows,
    load_committed,
    read_conv_windows,
)


@contextlib.contextmanager
def gdn_layer_call(ctx: HybridTreeContext, layer: Any) -> Iterator[None]:
    """Publish ``layer`` and its ``GDNAttentionMetadata`` to the two kernel wrappers below for
    the duration of one ``_forward_core`` call (vLLM calls the kernels without the batch rows of
    the speculative sequences, which only the metadata has)."""
    from vllm.forward_context import get_forward_context

    md = get_forward_context().attn_metadata
    md = md.get(layer.prefix) if isinstance(md, dict) else None
    prev, ctx.gdn_call = ctx.gdn_call, ((layer, md) if md is not None else None)
    try:
        yield
    finally:
        ctx.gdn_call = prev


def is_speculative_call(num_accepted_tokens: torch.Tensor | None) -> bool:
    """vLLM passes ``num_accepted_tokens`` to both GDN kernels for speculative rows only."""
    return num_accepted_tokens is not None


def tree_conv_update(
    ctx: HybridTreeContext,
    original: Callable[..., torch.Tensor],
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: Any,
) -> torch.Tensor:
    """The speculative conv of a GDN layer, each node over its ancestor window.

    Args:
        original: vLLM's Triton ``causal_conv1d_update`` (as the GDN module imported it).
        x: ``[T, dim]`` pre-conv ``mixed_qkv`` of the speculative rows (spec order).
        conv_state: ``[slots, dim, W - 1 + K]`` the layer's conv cache view (read here; the
            commit after verification writes the accepted path's inputs).
        weight: ``[dim, W]``; bias: ``[dim]``; activation: as vLLM passes it.

    Returns:
        ``[T, dim]`` conv outputs, in ``x``'s dtype.
    """
    _, md = ctx.gdn_call
    width = weight.shape[-1]
    layout, index = gdn_layout(ctx, md, width)
    prior = read_conv_windows(conv_state, layout, width)
    windows = gather_conv_windows(x, prior, index)
    x_in = x.clone()  # first: the Triton op overwrites x
    out = conv_through_kernel(original, x, windows, conv_state, weight, bias, activation)
    ctx.record(RecurrentRecord(layout, width, conv_state, prior, x_in))
    return out.to(x.dtype)


def tree_gated_delta_update(
    ctx: HybridTreeContext,
    original: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    *,
    A_log: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    dt_bias: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    initial_state: torch.Tensor,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The speculative recurrence of a GDN layer, every node from its parent's state.

    Args:
        original: vLLM's ``fused_sigmoid_gating_delta_rule_update``.
        A_log, dt_bias: ``[HV]``; a, b: ``[T, HV]`` gate inputs of the speculative rows.
        q, k: ``[1, T, H, K]``; v: ``[1, T, HV, V]`` (after the conv, spec order).
        initial_state: ``[slots, HV, V, K]`` the layer's recurrent-state cache: the committed
            states are read from it; the nodes' states live in a level scratch, and the commit
            after verification writes the accepted path's state to block ``a``.
        kwargs: vLLM's other arguments (``use_qk_l2norm_in_kernel``, ``scale``, …), passed on;
            its ``cu_seqlens`` / ``ssm_state_indices`` / ``num_accepted_tokens`` /
            ``inplace_final_state`` are replaced per depth level.

    Returns:
        ``(o [1, T, HV, V], initial_state)``, what vLLM's call returns in spec mode.
    """
    _, md = ctx.gdn_call
    layout, _ = gdn_layout(ctx, md, None)
    for name in ("cu_seqlens", "ssm_state_indices", "num_accepted_tokens", "inplace_final_state"):
        kwargs.pop(name, None)
    dev = q.device
    # Copies: the replay after verification reads them after later layers reuse the buffers.
    q, k, v, a, b = (t.clone() for t in (q, k, v, a, b))
    o = torch.empty(1, q.shape[1], v.shape[2], v.shape[3], dtype=q.dtype, device=dev)

    def advance(lay: RecurrentTreeLayout, scratch: torch.Tensor,
                out: torch.Tensor | None = None) -> None:
        for level in lay.levels:
            lv = level.to(dev)
            n = lv.numel()
            rows = torch.stack([lay.dst_slots[level], lay.src_slots[level]], dim=1)
            got, _ = original(
                A_log=A_log, a=a[lv], b=b[lv], dt_bias=dt_bias, q=q[:, lv], k=k[:, lv],
                v=v[:, lv], initial_state=scratch, inplace_final_state=True,
                cu_seqlens=torch.arange(n + 1, dtype=torch.int32, device=dev),
                ssm_state_indices=rows.to(dev, torch.int32),
                num_accepted_tokens=torch.full((n,), 2, dtype=torch.int32, device=dev),
                **kwargs,
            )
            if out is not None:
                out[:, lv] = got.reshape(1, n, *out.shape[2:]).to(out.dtype)

    scratch = load_committed(layout, initial_state)
    advance(layout, scratch, o)
    ctx.record(RecurrentRecord(layout, states=initial_state, advance=advance), scratch)
    return o, initial_state
