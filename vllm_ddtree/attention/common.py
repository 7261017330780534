"""The per-step channel between the DDTree runner hooks and the tree-attention backends.

vLLM builds attention metadata per KV-cache group and never sees our trees, so the runner hook
publishes a :class:`TreeAttentionBatch` for exactly the duration of the target model's forward
(:func:`tree_attention_active`). Backends read it with :func:`active_tree_batch`; outside that
window (drafter forward, dummy/profile runs) it is ``None`` and backends behave exactly as vLLM's.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch


@dataclass
class TreeAttentionRequest:
    """One request's draft tree as laid out in this step's flat token batch.

    Attributes:
        batch_index: the request's row in the block table / ``seq_lens`` of this step.
        query_start: flat index (into the step's ``[num_tokens]`` batch) of the root row; the
            tree's rows are ``query_start .. query_start + num_rows - 1`` in node order.
        num_rows: ``n + 1`` (root/bonus token plus ``n`` draft nodes).
        context_len: number of committed tokens before the root (= the root's position).
            Tree node ``i`` was written to the KV slot of position ``context_len + i``.
        ancestor_mask: ``[num_rows, num_rows]`` bool on the model's device; row ``i`` is true at
            ``j`` iff ``j`` is ``i`` or an ancestor of ``i`` (see ``vllm_ddtree.tree.DraftTree``).
    """

    batch_index: int
    query_start: int
    num_rows: int
    context_len: int
    ancestor_mask: torch.Tensor


@dataclass
class TreeAttentionBatch:
    """All tree requests of one target forward, plus the K/V each attention layer wrote.

    ``recorded_kv`` maps a layer name to ``(layer, impl, key, value, kv_cache)`` as seen by the
    backend's ``do_kv_cache_update``; :mod:`vllm_ddtree.commit` rewrites the accepted nodes'
    K/V through the same backend writer (layout-agnostic KV compaction). ``backend_cache`` holds
    per-step plans the backends derive from ``requests`` (never read by anything else).
    """

    requests: list[TreeAttentionRequest]
    #: ``[sum(num_rows)]`` long: the flat token rows of all trees, request after request.
    tree_rows: torch.Tensor | None = None
    recorded_kv: dict[str, tuple[Any, Any, torch.Tensor, torch.Tensor, torch.Tensor]] = field(
        default_factory=dict
    )
    #: Scratch space for backends: work that depends only on this step's trees and attention
    #: metadata (shared by every attention layer of the forward) is computed once and kept here,
    #: keyed by the backend (e.g. :mod:`vllm_ddtree.attention.cpu`'s per-step wave plan).
    backend_cache: dict[Any, Any] = field(default_factory=dict)

    def record_kv(self, layer: Any, impl: Any, key: torch.Tensor, value: torch.Tensor,
                  kv_cache: torch.Tensor) -> None:
        """Remember a layer's fresh K/V of the tree rows for KV compaction after verification.

        Args:
            key, value: ``[num_tokens, num_kv_heads, head_size]`` as passed to
                ``do_kv_cache_update``; only the rows in ``tree_rows`` are kept (copied, so a
                reused activation buffer cannot change them before the commit).
            kv_cache: the layer's paged cache tensor (any layout; the commit writes through
                ``impl.do_kv_cache_update``).
        """
        name = getattr(layer, "layer_name", None) or str(id(layer))
        if self.tree_rows is not None:
            key = key.index_select(0, self.tree_rows)
            value = value.index_select(0, self.tree_rows)
        self.recorded_kv[name] = (layer, impl, key, value, kv_cache)


_ACTIVE: TreeAttentionBatch | None = None


@contextlib.contextmanager
def tree_attention_active(batch: TreeAttentionBatch | None) -> Iterator[None]:
    """Publish ``batch`` to the tree-attention backends for the enclosed forward pass."""
    global _ACTIVE
    prev, _ACTIVE = _ACTIVE, batch
    try:
        yield
    finally:
        _ACTIVE = prev


def active_tree_batch() -> TreeAttentionBatch | None:
    """The tree batch of the target forward now running, or ``None``."""
    return _ACTIVE


def publish_tree_batch(batch: TreeAttentionBatch | None) -> None:
    """Publish ``batch`` (``None``: no trees) until the next call.

    For runners whose target forward is not one call the plugin can wrap (Model Runner V2:
    published in ``ModelState.prepare_inputs``, cleared at verification and before every
    attention-metadata build, so no other forward sees a step's trees).
    """
    global _ACTIVE
    _ACTIVE = batch
