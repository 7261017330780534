"""DDTree tree attention on vLLM's CPU backend.

vLLM's CPU platform always selects ``AttentionBackendEnum.CPU_ATTN``
(``vllm/platforms/cpu.py``, ``CpuPlatform.get_attn_backend_cls``), so the plugin overrides that
member with :class:`DDTreeCPUAttentionBackend`. The backend is vLLM's own
(``vllm/v1/attention/backends/cpu_attn.py``: ``CPUAttentionBackend``, metadata builder, KV layout
and writer all inherited); only the impl changes, and only while a
:class:`~vllm_ddtree.attention.common.TreeAttentionBatch` is published for the target's
verification forward:

* ``do_kv_cache_update`` additionally records the layer's fresh K/V for KV compaction;
* ``forward`` runs vLLM's kernel for the whole batch, then recomputes every tree request's rows
  with the ancestor-only mask of the DDTree paper (§3) in torch
  (:func:`vllm_ddtree.attention.paged.tree_attention_reference`) over the committed prefix read
  back from the paged cache plus the tree's own keys. This plays the role of the removed
  ``tree_attn.py``'s ``qq_bias`` path (vLLM PR #20401, removed by #42121) with a per-request mask.
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backend import AttentionLayer, AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
)

from vllm_ddtree.attention.common import (
    TreeAttentionBatch,
    TreeAttentionRequest,
    active_tree_batch,
)
from vllm_ddtree.attention.paged import gather_paged_kv, tree_attention_reference

__all__ = ["DDTreeCPUAttentionBackend", "DDTreeCPUAttentionImpl"]


class DDTreeCPUAttentionBackend(CPUAttentionBackend):
    """``CPU_ATTN`` with tree-aware verification rows.

    Identical to vLLM's ``CPUAttentionBackend`` (same name ``"CPU_ATTN"`` -- vLLM compares backend
    names -- same KV-cache shape/layout, metadata builder and capabilities) except that
    :meth:`get_impl_cls` returns :class:`DDTreeCPUAttentionImpl`. Registered by the plugin with
    ``register_backend(AttentionBackendEnum.CPU_ATTN,
    "vllm_ddtree.attention.cpu.DDTreeCPUAttentionBackend")``.
    """

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"

    @staticmethod
    def get_impl_cls() -> type["DDTreeCPUAttentionImpl"]:
        return DDTreeCPUAttentionImpl


class DDTreeCPUAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's ``CPUAttentionBackendImpl`` plus ancestor-only attention for DDTree tree rows.

    Without an active tree batch (drafter forward, warm-up/profile runs, plain decoding) every
    method is exactly vLLM's. With one, the rows of each
    :class:`~vllm_ddtree.attention.common.TreeAttentionRequest` are overwritten with tree
    attention; all other rows keep vLLM's result bit for bit.

    Tree rows refuse (``NotImplementedError``) sliding window, ALiBi, logits soft cap, attention
    sinks, fp8 KV cache, fused output quantization and non-causal metadata rather than return a
    result that is not the ancestor-only attention.
    """

    # ------------------------------------------------------------------ KV write
    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """vLLM's CPU KV write (``ops.cpu_attn_reshape_and_cache``), then, during a tree
        verification forward of a decoder self-attention layer, ``batch.record_kv(layer, self,
        key, value, kv_cache)``.

        Args:
            key, value: ``[num_tokens, num_kv_heads, head_size]``.
            kv_cache: ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``.
            slot_mapping: ``[num_tokens]`` int64 flat slot per token.
        """
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        batch = active_tree_batch()
        # Encoder layers write nothing (vLLM returns early) and cross-attention K/V do not live
        # at tree positions, so only decoder self-attention K/V are kept for compaction.
        if batch is not None and self.attn_type == AttentionType.DECODER:
            batch.record_kv(layer, self, key, value, kv_cache)

    # ------------------------------------------------------------------ attention
    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: CPUAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """vLLM's CPU attention, with tree rows recomputed under the ancestor-only mask.

        Args:
            layer: the ``Attention`` layer (provides ``isa``, set by vLLM's metadata builder).
            query: ``[num_tokens, num_heads, head_size]`` (``num_tokens`` may include padding
                beyond ``attn_metadata.num_actual_tokens``).
            key, value: ``[num_tokens, num_kv_heads, head_size]``, this step's fresh K/V (already
                written to ``kv_cache`` by :meth:`do_kv_cache_update`); ``None`` is tolerated for
                tree rows (the tree's K/V are then read from the cache).
            kv_cache: ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``.
            attn_metadata: ``CPUAttentionMetadata`` (``None`` during warm-up).
            output: ``[num_tokens, num_heads, head_size]`` -- what vLLM 0.32's
                ``Attention.forward`` / ``unified_attention_with_output`` pass -- or
                ``[num_tokens, num_heads * head_size]``; written in place.

        Returns:
            ``output``.

        Raises:
            NotImplementedError: a tree row on a layer with sliding window, ALiBi, soft cap,
                sinks, fp8 KV cache or non-causal attention, or on an unverified KV layout.
            ValueError: a tree request inconsistent with the batch metadata (rows outside its
                request, or ``context_len`` not the root's position).
        """
        batch = active_tree_batch()
        if (
            batch is None
            or not batch.requests
            or attn_metadata is None
            or self.attn_type != AttentionType.DECODER
        ):
            return super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale, output_block_scale,
            )

        self._refuse_unsupported_tree_features(attn_metadata)
        result = super().forward(
            layer, query, key, value, kv_cache, attn_metadata, output,
            output_scale, output_block_scale,
        )
        self._overwrite_tree_rows(layer, query, key, value, kv_cache, attn_metadata, output,
                                  batch)
        return result

    def _refuse_unsupported_tree_features(self, attn_metadata: CPUAttentionMetadata) -> None:
        unsupported = []
        if self.sliding_window not in (-1, None):
            unsupported.append(f"sliding window ({self.sliding_window})")
        if self.alibi_slopes is not None:
            unsupported.append("ALiBi")
        if self.logits_soft_cap:
            unsupported.append(f"logits soft cap ({self.logits_soft_cap})")
        if self.sinks is not None:
            unsupported.append("attention sinks")
        if self.is_fp8_kv_cache:
            unsupported.append(f"fp8 KV cache ({self.kv_cache_dtype})")
        if not attn_metadata.causal and attn_metadata.dynamic_causal is None:
            unsupported.append("non-causal attention metadata")
        if unsupported:
            raise NotImplementedError(
                "DDTree tree attention on CPU does not support " + ", ".join(unsupported)
                + " on tree rows"
            )

    def _overwrite_tree_rows(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: CPUAttentionMetadata,
        output: torch.Tensor,
        batch: TreeAttentionBatch,
    ) -> None:
        num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
        key_cache, value_cache = kv_cache.view(
            num_blocks, num_kv_heads, 2 * block_size, -1
        ).chunk(2, dim=2)
        isa = getattr(layer, "isa", None)
        if isa is None:
            raise ValueError("attention layer has no 'isa' (set by CPUAttentionMetadataBuilder)")
        out = output.view(output.shape[0], self.num_heads, -1) if output.dim() == 2 else output
        query_start_loc = attn_metadata.query_start_loc.tolist()
        seq_lens = attn_metadata.seq_lens.tolist()
        dynamic_causal = attn_metadata.dynamic_causal
        # A layer sharing another layer's cache gets its K/V from that cache, not from `key`.
        fresh_kv = (
            key is not None and value is not None and self.kv_sharing_target_layer_name is None
        )

        for req in batch.requests:
            self._check_request(req, query_start_loc, seq_lens, attn_metadata.num_actual_tokens)
            if dynamic_causal is not None and not bool(dynamic_causal[req.batch_index]):
                raise NotImplementedError(
                    "DDTree tree attention on CPU does not support non-causal attention on tree "
                    f"rows (request {req.batch_index})"
                )
            rows = slice(req.query_start, req.query_start + req.num_rows)
            block_row = attn_metadata.block_table[req.batch_index]
            if fresh_kv:
                prefix_k, prefix_v = gather_paged_kv(
                    key_cache, value_cache, block_row, req.context_len, isa
                )
                keys = torch.cat([prefix_k, key[rows].to(prefix_k.dtype)], dim=0)
                values = torch.cat([prefix_v, value[rows].to(prefix_v.dtype)], dim=0)
            else:
                keys, values = gather_paged_kv(
                    key_cache, value_cache, block_row, req.context_len + req.num_rows, isa
                )
            result = tree_attention_reference(
                query[rows], keys, values, req.context_len, req.ancestor_mask, self.scale
            )
            out[rows] = result.to(out.dtype)

    @staticmethod
    def _check_request(
        req: TreeAttentionRequest,
        query_start_loc: list[int],
        seq_lens: list[int],
        num_actual_tokens: int,
    ) -> None:
        b = req.batch_index
        if not 0 <= b < len(seq_lens):
            raise ValueError(f"tree request batch_index {b} outside the batch ({len(seq_lens)})")
        q_lo, q_hi = query_start_loc[b], query_start_loc[b + 1]
        end = req.query_start + req.num_rows
        if req.num_rows < 1 or req.query_start < q_lo or end > q_hi or end > num_actual_tokens:
            raise ValueError(
                f"tree rows [{req.query_start}, {end}) are not inside request {b}'s rows "
                f"[{q_lo}, {q_hi})"
            )
        root_position = seq_lens[b] - (q_hi - q_lo) + (req.query_start - q_lo)
        if req.context_len != root_position:
            raise ValueError(
                f"tree request {b}: context_len {req.context_len} but its root row sits at "
                f"position {root_position}"
            )
        if tuple(req.ancestor_mask.shape) != (req.num_rows, req.num_rows):
            raise ValueError(
                f"tree request {b}: ancestor_mask {tuple(req.ancestor_mask.shape)} for "
                f"{req.num_rows} rows"
            )
