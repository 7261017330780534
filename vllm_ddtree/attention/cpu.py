"""DDTree tree attention on vLLM's CPU backend.

vLLM's CPU platform always selects ``AttentionBackendEnum.CPU_ATTN``
(``vllm/platforms/cpu.py``, ``CpuPlatform.get_attn_backend_cls``), so the plugin overrides that
member with :class:`DDTreeCPUAttentionBackend`. The backend is vLLM's own
(``vllm/v1/attention/backends/cpu_attn.py``: ``CPUAttentionBackend``, metadata builder, KV layout
and writer all inherited); only the impl changes, and only while a
:class:`~vllm_ddtree.attention.common.TreeAttentionBatch` is published for the target's
verification forward:

* ``do_kv_cache_update`` additionally records the layer's fresh K/V for KV compaction;
* ``forward`` runs vLLM's kernel for the whole batch, then recomputes the tree rows that the
  causal result got wrong (rows with a sibling branch among their predecessors) under the
  ancestor-only mask of the DDTree paper (§3) — again with vLLM's own kernel, over each row's
  ancestor path laid out contiguously in the tree's KV slots, so tree rows round exactly like
  target-only decoding in bf16 as in fp32. The torch
  :func:`vllm_ddtree.attention.paged.tree_attention_reference` is the test oracle. This plays the role of the removed
  ``tree_attn.py``'s ``qq_bias`` path (vLLM PR #20401, removed by #42121) with a per-request mask.
"""

from __future__ import annotations

import torch
from vllm import _custom_ops as ops
from vllm import envs
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
from vllm_ddtree.attention.paged import gather_paged_kv

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
        """Recompute every tree row whose ancestors are not simply the rows before it.

        A row whose ancestor-or-self set is ``{0 … i}`` (the root and a spine prefix) already got
        the right result from vLLM's causal kernel. Every other row is recomputed **with vLLM's
        own kernel** (``ops.cpu_attention_with_kv_cache``), so tree rows round exactly like
        target-only decoding in every dtype: the row's ancestor path is written (through vLLM's
        KV writer) into the request's tree slots ``context_len .. context_len + depth`` in path
        order, the kernel runs the row as a one-token causal query over that contiguous path,
        and the tree's own K/V are written back afterwards. One node per tree request is handled
        per kernel call (different requests use different slots), so a step costs at most
        ``max(n)`` extra kernel calls per layer.
        """
        isa = getattr(layer, "isa", None)
        if isa is None:
            raise ValueError("attention layer has no 'isa' (set by CPUAttentionMetadataBuilder)")
        out = output.view(output.shape[0], self.num_heads, -1) if output.dim() == 2 else output
        query_start_loc = attn_metadata.query_start_loc.tolist()
        seq_lens = attn_metadata.seq_lens.tolist()
        dynamic_causal = attn_metadata.dynamic_causal
        fresh_kv = (
            key is not None and value is not None and self.kv_sharing_target_layer_name is None
        )
        num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
        key_cache, value_cache = kv_cache.view(
            num_blocks, num_kv_heads, 2 * block_size, -1
        ).chunk(2, dim=2)

        # Per request: the rows to recompute, each with its ancestor path (root first).
        todo: list[tuple[TreeAttentionRequest, torch.Tensor, list[tuple[int, list[int]]]]] = []
        for req in batch.requests:
            self._check_request(req, query_start_loc, seq_lens, attn_metadata.num_actual_tokens)
            if dynamic_causal is not None and not bool(dynamic_causal[req.batch_index]):
                raise NotImplementedError(
                    "DDTree tree attention on CPU does not support non-causal attention on tree "
                    f"rows (request {req.batch_index})"
                )
            mask = req.ancestor_mask.to("cpu")
            prefix = torch.ones(req.num_rows, req.num_rows, dtype=torch.bool).tril()
            rows = [
                (i, torch.nonzero(mask[i]).flatten().tolist())
                for i in range(req.num_rows)
                if not torch.equal(mask[i], prefix[i])
            ]
            if not rows:
                continue
            lo, hi = req.query_start, req.query_start + req.num_rows
            if fresh_kv:
                tree_k, tree_v = key[lo:hi], value[lo:hi]
            else:  # a layer sharing another layer's cache: the tree's K/V are in the cache
                tree_k, tree_v = gather_paged_kv(
                    key_cache, value_cache, attn_metadata.block_table[req.batch_index],
                    req.context_len + req.num_rows, isa,
                )
                tree_k, tree_v = tree_k[req.context_len :], tree_v[req.context_len :]
            todo.append((req, (tree_k, tree_v), rows))
        if not todo:
            return

        slots_all = attn_metadata.slot_mapping
        for t in range(max(len(rows) for _, _, rows in todo)):
            wave = [(req, kv, rows[t]) for req, kv, rows in todo if t < len(rows)]
            ks, vs, slots, qrows, lens, tables = [], [], [], [], [], []
            for req, (tree_k, tree_v), (i, path) in wave:
                idx = torch.tensor(path, dtype=torch.long, device=tree_k.device)
                ks.append(tree_k.index_select(0, idx))
                vs.append(tree_v.index_select(0, idx))
                slots.append(slots_all[req.query_start : req.query_start + len(path)])
                qrows.append(req.query_start + i)
                lens.append(req.context_len + len(path))
                tables.append(req.batch_index)
            CPUAttentionBackendImpl.do_kv_cache_update(
                self, layer, torch.cat(ks), torch.cat(vs), kv_cache, torch.cat(slots)
            )
            self._kernel_rows(layer, query, out, key_cache, value_cache, attn_metadata, isa,
                              qrows, lens, tables)
        # Restore the tree's own K/V in node order (the layout the commit step expects).
        for req, (tree_k, tree_v), _ in todo:
            CPUAttentionBackendImpl.do_kv_cache_update(
                self, layer, tree_k, tree_v, kv_cache,
                slots_all[req.query_start : req.query_start + req.num_rows],
            )

    def _kernel_rows(self, layer, query, out, key_cache, value_cache, attn_metadata, isa,
                     qrows: list[int], lens: list[int], tables: list[int]) -> None:
        """Run vLLM's CPU kernel for single query rows as one-token causal requests."""
        dev = query.device
        n = len(qrows)
        q = query[torch.tensor(qrows, device=dev)].contiguous()
        res = torch.empty_like(q)
        query_start_loc = torch.arange(n + 1, dtype=attn_metadata.query_start_loc.dtype,
                                       device=dev)
        seq_lens = torch.tensor(lens, dtype=attn_metadata.seq_lens.dtype, device=dev)
        block_table = attn_metadata.block_table[torch.tensor(tables, device=dev)]
        meta = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=n, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_size, seq_lens=seq_lens, dtype=query.dtype,
            query_start_loc=query_start_loc, causal=True, sliding_window_size=-1, isa=isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=None,
            kv_cache_dtype=self.kv_cache_dtype,
        )
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=key_cache, value_cache=value_cache, output=res,
            query_start_loc=query_start_loc, seq_lens=seq_lens, scale=self.scale, causal=True,
            alibi_slopes=None, sliding_window=-1, block_table=block_table, softcap=0,
            scheduler_metadata=meta, s_aux=None, dynamic_causal=None,
            k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
            kv_cache_dtype=self.kv_cache_dtype,
        )
        out[torch.tensor(qrows, device=dev)] = res.to(out.dtype)

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
