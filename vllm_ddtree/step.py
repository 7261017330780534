"""One DDTree engine step as data: which rows of vLLM's flat token batch hold which draft tree.

vLLM's scheduler sees each request's draft nodes as a flat list of speculative tokens (node order)
behind the bonus token, so it lays a request out as rows ``[bonus, node_1 … node_n]`` of the
step's token batch and writes node ``i``'s K/V to the slot of *chain* position
``context_len + i``. :func:`lay_out_step` turns that layout (:class:`ScheduledDrafts`, built
by each runner adapter from its own batch) plus the proposer's trees into a
:class:`TreeStep`: the rows of every tree, the positions the model must read
(``root_position + depth``, siblings share one; paper §3.3) and the ancestor masks for the
attention backends. Trees are keyed by request id, never by shape or batch slot.

The scheduler may schedule fewer than B nodes (token budget, ``max_model_len``). Nodes are in pop
order with parents before children, so the first ``n`` nodes are still a valid draft tree
(:func:`truncate_tree`). If the scheduled tokens are not the proposer's tree (vLLM zero-filled
the drafts because the input did not fit the drafter, or no tree is known) the request is verified
as a plain chain, which is exact for any token list.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import torch

from vllm_ddtree.attention.common import TreeAttentionBatch, TreeAttentionRequest
from vllm_ddtree.tree import DraftTree, chain_tree


def truncate_tree(tree: DraftTree, n: int) -> DraftTree:
    """The draft tree made of the root and the first ``n`` nodes of ``tree`` (pop order).

    Valid because every node's parent precedes it (paper Alg. 1 pops parents first).

    Raises:
        ValueError: ``n`` is negative or larger than ``tree.num_nodes``.
    """
    if not 0 <= n <= tree.num_nodes:
        raise ValueError(f"cannot truncate a tree of {tree.num_nodes} nodes to {n}")
    if n == tree.num_nodes:
        return tree
    return DraftTree(
        token_ids=tree.token_ids[:n],
        parents=tree.parents[: n + 1],
        depths=tree.depths[: n + 1],
        ancestor_mask=tree.ancestor_mask[: n + 1, : n + 1],
        path_log_probs=tree.path_log_probs[: n + 1],
    )


@dataclass
class StepRequest:
    """One request verified as a draft tree in this step.

    Attributes:
        req_id: vLLM request id.
        batch_index: the request's row in this step's input batch.
        root_row: flat token row of the root (bonus) token; node ``i`` is row ``root_row + i``.
        context_len: committed tokens before the root (the root's position).
        tree: the (possibly truncated) draft tree; ``tree.num_nodes`` = scheduled drafts.
        is_tree: False when verified as a plain chain (no matching tree was proposed, or the
            proposed tree is chain-shaped).
        accepted: node indices of the accepted path (set by verification), starting with 0.
        proposed: ``tree`` is (a prefix of) the proposer's tree, so its ``path_log_probs`` are
            the drafter's; False for a chain built from the scheduled tokens (log-probs 0).
    """

    req_id: str
    batch_index: int
    root_row: int
    context_len: int
    tree: DraftTree
    is_tree: bool
    accepted: list[int] = field(default_factory=list)
    proposed: bool = True

    @property
    def num_rows(self) -> int:
        return self.tree.num_nodes + 1


@dataclass
class TreeStep:
    """Every request of one step that carries draft tokens, plus the data the hooks need.

    Attributes:
        requests: requests with at least one scheduled draft, in batch order.
        position_rows: ``[M]`` long, flat rows whose position differs from the chain position.
        tree_positions: ``[M]`` long, ``root_position + depth`` for those rows.
        chain_positions: ``[M]`` long, the positions vLLM computed (restored after the forward
            so the drafter and bookkeeping see the chain layout of the committed path).
        attn_batch: what the tree-attention backends read during the target forward (only
            requests whose tree is not a chain; a chain is causal attention, vLLM's own path).
        slot_mappings: per-layer slot mappings of the forward (captured for KV compaction).
        aux_hidden_states: the target's tapped hidden states of the forward (DFlash context).
        cache_layers: CUDA only: ``layer_name -> (impl, kv_cache)`` of the target's tree-attention
            layers, for KV compaction inside the caches.
    """

    requests: list[StepRequest]
    position_rows: torch.Tensor
    tree_positions: torch.Tensor
    chain_positions: torch.Tensor
    attn_batch: TreeAttentionBatch
    slot_mappings: Mapping[str, torch.Tensor] | None = None
    aux_hidden_states: Sequence[torch.Tensor] | None = None
    cache_layers: Mapping[str, tuple] | None = None


def _is_chain(tree: DraftTree) -> bool:
    n = tree.num_nodes
    return bool(torch.equal(tree.parents, torch.arange(-1, n, dtype=tree.parents.dtype)))


@dataclass(frozen=True)
class ScheduledDrafts:
    """Where one request's draft rows sit in this step's flat token batch (runner-independent).

    Attributes:
        req_id: vLLM request id (trees are keyed by it).
        batch_index: the request's row in this step's input batch.
        root_row: flat token row of the root (bonus) token; draft ``i`` is row ``root_row + i``.
        context_len: committed tokens before the root (the root's position).
        num_drafts: draft rows scheduled behind the root.
        tokens: the scheduled draft tokens when the runner has them on the host (V1: the
            scheduler's lists); ``None`` when the runner fed the proposer's tokens itself (V2).
    """

    req_id: str
    batch_index: int
    root_row: int
    context_len: int
    num_drafts: int
    tokens: Sequence[int] | None = None


def lay_out_step(
    scheduled: Sequence[ScheduledDrafts],
    trees: Mapping[str, DraftTree],
    device: torch.device | str = "cpu",
) -> TreeStep | None:
    """Pair each request's scheduled draft rows with its proposed tree: the step plan.

    A request's tree is used when one is known and, where the runner knows the scheduled tokens,
    they are the tree's first nodes. The scheduler may schedule fewer rows than the tree has
    nodes (token budget, ``max_model_len``): the tree is truncated (:func:`truncate_tree`). It may
    also schedule more (V2 reserves ``max(B, L)`` rows per request): rows past the tree's nodes
    are padding, outside the tree, never accepted. Without a usable tree the scheduled tokens
    are verified as a plain chain, which is exact for any token list.

    Args:
        scheduled: requests that carry draft rows this step, in batch order.
        trees: the proposer's trees by request id.
        device: where the position and mask tensors go (the model's device).

    Returns:
        the step plan, or ``None`` when ``scheduled`` is empty.

    Raises:
        ValueError: a request has neither a usable tree nor host-side draft tokens.
    """
    requests: list[StepRequest] = []
    for s in scheduled:
        tree = trees.get(s.req_id)
        n = min(s.num_drafts, tree.num_nodes) if tree is not None else s.num_drafts
        is_tree = tree is not None and (
            s.tokens is None or tree.token_ids[:n].tolist() == list(s.tokens)[:n])
        if s.tokens is not None and is_tree and s.num_drafts > n:
            is_tree = False  # V1 schedules the proposer's list: more tokens means another list
        proposed = is_tree
        if is_tree:
            tree = truncate_tree(tree, n)
            is_tree = not _is_chain(tree)
        else:
            if s.tokens is None:
                raise ValueError(f"request {s.req_id}: no draft tree and no draft tokens")
            tree = chain_tree(torch.tensor(list(s.tokens), dtype=torch.long))
        requests.append(StepRequest(s.req_id, s.batch_index, s.root_row, s.context_len, tree,
                                    is_tree, proposed=proposed))
    if not requests:
        return None

    # numpy: a handful of small arrays per request, where torch's per-op cost dominated.
    rows, tpos, cpos = [], [], []
    attn_reqs: list[TreeAttentionRequest] = []
    tree_rows = []
    for r in requests:
        if not r.is_tree:
            continue
        depths = r.tree.depths.numpy()
        idx = np.arange(r.num_rows)
        moved = np.flatnonzero(depths != idx)  # rows whose depth position differs from the chain
        rows.append(r.root_row + moved)
        tpos.append(r.context_len + depths[moved])
        cpos.append(r.context_len + moved)
        attn_reqs.append(
            TreeAttentionRequest(
                batch_index=r.batch_index,
                query_start=r.root_row,
                num_rows=r.num_rows,
                context_len=r.context_len,
                ancestor_mask=r.tree.ancestor_mask.to(device),
            )
        )
        tree_rows.append(r.root_row + idx)

    def cat(xs: list[np.ndarray]) -> torch.Tensor:
        flat = np.concatenate(xs) if xs else np.zeros(0, dtype=np.int64)
        return torch.from_numpy(flat.astype(np.int64, copy=False)).to(device)

    return TreeStep(
        requests=requests,
        position_rows=cat(rows),
        tree_positions=cat(tpos),
        chain_positions=cat(cpos),
        attn_batch=TreeAttentionBatch(attn_reqs, tree_rows=cat(tree_rows) if tree_rows else None),
    )
