"""Mamba2 (Nemotron-H, Granite-4 / GraniteMoeHybrid) speculative rows through the tree oracle.

vLLM's Mamba2 mixer (``vllm/model_executor/layers/mamba/mamba_mixer2.py``) runs its decode rows
through two module-level ops, ``causal_conv1d_update`` and ``selective_state_update`` (on CUDA
the Triton conv and the Triton or FlashInfer SSU backend; on CPU vLLM's C++ ops). While a
DDTree hybrid step is active, their speculative calls (2-D ``state_indices``, one row of
``K + 1`` slots per request) are replaced here: each node's conv window is gathered along its
ancestor path, and its SSM state is advanced from its parent's, one depth level at a time, by
the same one-token calls target-only decoding makes (narrow conv state, one slot per row), in
the oracle's level scratch; after verification the accepted path is replayed into vLLM's state
block and its conv inputs laid into the conv buffer (:mod:`vllm_ddtree.hybrid.oracle`).

On CPU vLLM 0.32 both ops are wrong in speculative mode even for a chain (the conv ignores
``num_accepted_tokens`` and reads a wider state as extra taps; the SSM ignores
``num_accepted_tokens``), so vLLM's own Mamba2 speculative decoding changes greedy output from
the second token; the oracle never calls them that way. Prefill rows stay vLLM's.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from vllm_ddtree.hybrid.context import HybridTreeContext, RecurrentRecord
from vllm_ddtree.hybrid.oracle import (
    RecurrentTreeLayout,
    conv_through_kernel,
    gather_conv_windows,
    load_committed,
    read_conv_windows,
    run_tree_levels,
)


def is_speculative_call(state_indices: torch.Tensor | None) -> bool:
    """vLLM passes ``[N, K + 1]`` state indices for speculative rows, 1-D or ``[N, 1]`` else."""
    return state_indices is not None and state_indices.dim() == 2 and state_indices.shape[1] > 1


def _layout(ctx: HybridTreeContext, state_indices: torch.Tensor, num_accepted: torch.Tensor,
            query_start_loc: torch.Tensor, width: int | None) -> tuple[RecurrentTreeLayout, Any]:
    """The step's layout for this metadata (decode rows are the first ``N`` batch rows)."""
    key = ("mamba2", state_indices.data_ptr(), tuple(state_indices.shape),
           num_accepted.data_ptr(), query_start_loc.data_ptr())

    def build():
        n = state_indices.shape[0]
        qsl = query_start_loc[: n + 1].cpu()
        return (qsl[1:] - qsl[:-1]).tolist(), list(range(n)), state_indices, num_accepted[:n]

    return ctx.layout(key, build, width, keep=(state_indices, num_accepted, query_start_loc))


def tree_conv_update(
    ctx: HybridTreeContext,
    original: Callable,
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: Any,
    conv_state_indices: torch.Tensor,
    num_accepted_tokens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> torch.Tensor:
    """The speculative conv of a Mamba2 mixer, each node over its ancestor window.

    Args:
        original: vLLM's ``causal_conv1d_update`` (called the way target-only decoding calls
            it: one token per row, a narrow ``W - 1`` scratch state holding the window).
        x: ``[T, dim]`` pre-conv ``xBC`` of the decode rows; conv_state: ``[slots, dim,
            W - 1 + K]`` view; weight: ``[dim, W]``; conv_state_indices: ``[N, K + 1]``;
        num_accepted_tokens: ``[N]``; query_start_loc: ``[N + 1]``.

    Returns:
        ``[T, dim]`` conv outputs (activation applied).
    """
    width = weight.shape[-1]
    layout, index = _layout(ctx, conv_state_indices, num_accepted_tokens, query_start_loc, width)
    prior = read_conv_windows(conv_state, layout, width)
    windows = gather_conv_windows(x, prior, index)
    x_in = x.clone()  # first: the Triton op overwrites x
    out = conv_through_kernel(original, x, windows, conv_state, weight, bias, activation)
    ctx.record(RecurrentRecord(layout, width, conv_state, prior, x_in))
    return out


def tree_state_update(
    ctx: HybridTreeContext,
    original: Callable,
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    state_batch_indices: torch.Tensor,
    out: torch.Tensor,
    num_accepted_tokens: torch.Tensor,
    cu_seqlens: torch.Tensor,
    **extra: Any,
) -> torch.Tensor:
    """The speculative SSM update of a Mamba2 mixer, every node from its parent's state.

    Each depth level, in the oracle's level scratch: parents' states are copied into the
    children's rows, then vLLM's ``selective_state_update`` advances them one token in place
    (vLLM's CPU op writes the source row too, so it is never given a parent's row). vLLM's
    state blocks are only read here; the commit after verification replays the accepted path
    into block ``a``.

    Args:
        state: ``[slots, H, P, N]``; x, dt: ``[T, H, P]``; A: ``[H, P, N]``; B, C:
            ``[T, G, N]``; D, dt_bias: ``[H, P]``; state_batch_indices: ``[N_req, K + 1]``;
        out: ``[T, H, P]`` written in place.

    Returns:
        ``out``.
    """
    layout, _ = _layout(ctx, state_batch_indices, num_accepted_tokens, cu_seqlens, None)
    # Copies: the replay after verification reads them after later layers reuse the buffers.
    x, dt, B, C = (t.clone() for t in (x, dt, B, C))

    def advance(lay: RecurrentTreeLayout, scratch: torch.Tensor,
                dest: torch.Tensor | None = None) -> None:
        def step(level: torch.Tensor, dst: torch.Tensor) -> None:
            lv = level.to(x.device)
            rows = dst.to(torch.int32).view(-1, 1)
            tmp = out.new_empty((lv.numel(), *out.shape[1:]))
            original(scratch, x[lv], dt[lv], A, B[lv], C[lv], D=D, dt_bias=dt_bias,
                     dt_softplus=dt_softplus, state_batch_indices=rows,
                     dst_state_batch_indices=rows, out=tmp, **extra)
            if dest is not None:
                dest[lv] = tmp

        run_tree_levels(lay, scratch, step)

    scratch = load_committed(layout, state)
    advance(layout, scratch, out)
    ctx.record(RecurrentRecord(layout, states=state, advance=advance), scratch)
    return out
