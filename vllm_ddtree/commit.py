"""Commit: KV compaction and the drafter context of the accepted path.

Tree node ``i`` of a request was written to the KV slot of chain position ``context_len + i``,
but vLLM's bookkeeping (``num_computed_tokens`` rollback after the step) believes accepted token
``j`` sits at ``context_len + j``. The accepted path ``[0, a_1 … a_k]`` is scattered, so for every
``j`` with ``a_j != j`` the K/V of node ``a_j`` is written to the slot of row ``j``, in every
target attention layer (every attention KV-cache group). K was rotated at ``context_len + depth``
and ``depth(a_j) = j``, so no re-rotation is needed (reference ``compact_dynamic_cache``,
DDTree paper §3.5 of our notes).

On CPU the write goes through each layer's own backend writer (``impl.do_kv_cache_update``)
with the node's K/V as recorded during the forward (:func:`compact_kv`), so the code is
independent of the ISA-specific packing of vLLM's CPU cache. On CUDA the slots are copied inside
each layer's cache (:func:`compact_kv_in_cache`), which a captured CUDA graph cannot skip.

The next DFlash pass reads the target's tapped hidden states of the committed tokens from the
first rows of each request (vLLM's padded drafter batch, ``prepare_inputs_padded``), so the
accepted nodes' rows are gathered to rows ``0..k`` in path order.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import torch

from vllm_ddtree.attention.common import TreeAttentionBatch
from vllm_ddtree.step import StepRequest


def path_moves(requests: Iterable[StepRequest]) -> list[tuple[int, int, int]]:
    """``(request_offset_in_tree_rows, src_node, dst_node)`` for every accepted node off its slot.

    Only requests verified as trees count (``is_tree``), in order, matching
    ``TreeAttentionBatch.tree_rows``; ``request_offset`` is where the request's rows start there.
    """
    moves, offset = [], 0
    for r in requests:
        if not r.is_tree:
            continue
        for j, a in enumerate(r.accepted):
            if a != j:
                moves.append((offset, a, j))
        offset += r.num_rows
    return moves


def compact_kv(
    batch: TreeAttentionBatch,
    requests: Sequence[StepRequest],
    slot_mappings: Mapping[str, torch.Tensor],
) -> int:
    """Write each accepted node's K/V to the slot of its committed position, in every layer.

    Args:
        batch: the tree batch of the forward, with the K/V each layer recorded
            (``[sum(tree rows), num_kv_heads, head_size]`` per layer).
        requests: the step's requests with ``accepted`` filled in by verification.
        slot_mappings: ``layer_name -> [num_tokens]`` int64 slot of every flat row.

    Returns:
        the number of node K/V rows moved per layer.

    Raises:
        KeyError: a layer recorded K/V but has no slot mapping.
    """
    tree_reqs = [r for r in requests if r.is_tree]
    roots = {}
    offset = 0
    for r in tree_reqs:
        roots[offset] = r.root_row
        offset += r.num_rows
    moves = path_moves(tree_reqs)
    if not moves:
        return 0
    src = torch.tensor([o + a for o, a, _ in moves], dtype=torch.long)
    dst_rows = torch.tensor([roots[o] + j for o, _, j in moves], dtype=torch.long)
    for name, (layer, impl, key, value, kv_cache) in batch.recorded_kv.items():
        slots = slot_mappings[name]
        dev = key.device
        impl.do_kv_cache_update(
            layer,
            key.index_select(0, src.to(dev)),
            value.index_select(0, src.to(dev)),
            kv_cache,
            slots.index_select(0, dst_rows.to(slots.device)),
        )
    return len(moves)


def compact_kv_in_cache(
    layers: Mapping[str, tuple[Any, torch.Tensor]],
    requests: Sequence[StepRequest],
    slot_mappings: Mapping[str, torch.Tensor],
) -> int:
    """KV compaction inside each layer's cache: copy node ``a_j``'s slot onto row ``j``'s slot.

    The CUDA path (:class:`vllm_ddtree.attention.cuda.DDTreeTritonAttentionImpl`): the tree's K/V
    are already in the cache, and a captured CUDA graph records no K/V in Python, so the copy
    reads the cache itself (one gather, then one scatter per layer: sources are read before any
    destination is written).

    Args:
        layers: ``layer_name -> (impl, kv_cache)`` of the target's decoder self-attention layers
            that own a cache (no KV-sharing layers: a second copy would read moved slots);
            ``impl.copy_kv_slots(kv_cache, src_slots, dst_slots)`` does the copy.
        requests: the step's requests with ``accepted`` filled in by verification.
        slot_mappings: ``layer_name -> [num_tokens]`` int64 slot of every flat row.

    Returns:
        the number of node K/V slots moved per layer.

    Raises:
        KeyError: a layer has no slot mapping.
    """
    src_rows, dst_rows = [], []
    for r in requests:
        if not r.is_tree:
            continue
        for j, a in enumerate(r.accepted):
            if a != j:
                src_rows.append(r.root_row + a)
                dst_rows.append(r.root_row + j)
    if not src_rows:
        return 0
    for name, (impl, kv_cache) in layers.items():
        slots = slot_mappings[name]
        src = torch.tensor(src_rows, dtype=torch.long, device=slots.device)
        dst = torch.tensor(dst_rows, dtype=torch.long, device=slots.device)
        impl.copy_kv_slots(kv_cache, slots.index_select(0, src).long().to(kv_cache.device),
                           slots.index_select(0, dst).long().to(kv_cache.device))
    return len(src_rows)


def gather_accepted_rows(tensors: Sequence[torch.Tensor], requests: Sequence[StepRequest]) -> None:
    """In place, move each accepted node's row to the row of its path index.

    Args:
        tensors: ``[num_tokens, ...]`` per-token tensors of the forward (the target's tapped
            hidden states for the DFlash context).
        requests: the step's requests with ``accepted`` filled in.
    """
    src, dst = [], []
    for r in requests:
        for j, a in enumerate(r.accepted):
            if a != j:
                src.append(r.root_row + a)
                dst.append(r.root_row + j)
    if not src:
        return
    for t in tensors:
        s = torch.tensor(src, dtype=torch.long, device=t.device)
        d = torch.tensor(dst, dtype=torch.long, device=t.device)
        t.index_copy_(0, d, t.index_select(0, s))  # gather first: sources are never clobbered


def relayout_recurrent(ctx: Any, requests: Sequence[Any]) -> None:
    """Commit every recurrent layer's accepted paths into vLLM's state blocks and conv buffers.

    After this, the state a chain of ``a`` accepted drafts would have left is where vLLM's
    chain bookkeeping reads it next step (``num_accepted_tokens = a + 1``): conv window at
    columns ``[a, a + W - 1)`` of the request's conv buffer, recurrent state in block ``a``
    (replayed along the path, :mod:`vllm_ddtree.hybrid.oracle`). Chains are committed the same
    way as trees.

    Args:
        ctx: the step's :class:`~vllm_ddtree.hybrid.context.HybridTreeContext`.
        requests: the step's ``StepRequest`` list with ``accepted`` set by verification.

    Raises:
        RuntimeError: a speculative sequence of several tokens has no accepted path (its
            state would be lost).
    """
    from vllm_ddtree.hybrid.oracle import path_layout

    accepted = {r.batch_index: r.accepted for r in requests}
    shared: dict[int, tuple] = {}  # layers of one KV-cache group share a layout: plan it once
    for rec in ctx.records:
        lay = rec.layout
        if id(lay) not in shared:
            paths = {}
            for n, b in enumerate(lay.batch_index):
                if n in rec.done:
                    continue
                path = accepted.get(b)
                if not path:
                    raise RuntimeError(
                        f"DDTree hybrid: batch row {b} ran {lay.seq_lens[n]} speculative tokens "
                        f"through a recurrent layer but verification gave it no accepted path")
                paths[n] = path
            shared[id(lay)] = (paths, path_layout(lay, paths) if paths else None)
        paths, chains = shared[id(lay)]
        rec.commit(paths, chains)


def commit_tree_step(step: Any, hybrid_ctx: Any = None) -> None:
    """Commit one verified step (either runner): KV compaction, drafter context (when the
    runner left the tapped hidden states on the step: V1), recurrent state.

    Args:
        step: the step's :class:`~vllm_ddtree.step.TreeStep`, every request's ``accepted`` set
            by verification.
        hybrid_ctx: the step's :class:`~vllm_ddtree.hybrid.context.HybridTreeContext` (hybrid
            targets) or ``None``.
    """
    if step.attn_batch.recorded_kv:  # CPU: K/V recorded during the forward
        compact_kv(step.attn_batch, step.requests, step.slot_mappings)
    elif step.cache_layers:  # CUDA: copied inside each layer's cache
        compact_kv_in_cache(step.cache_layers, step.requests, step.slot_mappings)
    if step.aux_hidden_states is not None:
        gather_accepted_rows(step.aux_hidden_states, step.requests)
    if hybrid_ctx is not None:
        relayout_recurrent(hybrid_ctx, step.requests)
