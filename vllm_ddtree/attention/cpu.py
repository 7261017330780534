"""DDTree tree attention on vLLM's CPU backend.

vLLM's CPU platform always selects ``AttentionBackendEnum.CPU_ATTN``
(``vllm/platforms/cpu.py``, ``CpuPlatform.get_attn_backend_cls``), so the plugin overrides that
member with :class:`DDTreeCPUAttentionBackend`. The backend is vLLM's own
(``vllm/v1/attention/backends/cpu_attn.py``: ``CPUAttentionBackend``, metadata builder, KV layout
and writer all inherited); only the impl changes, and only while a
:class:`~vllm_ddtree.attention.common.TreeAttentionBatch` is published for the target's
verification forward:

* ``do_kv_cache_update`` additionally records the layer's fresh K/V for KV compaction;
* ``forward`` runs vLLM's kernel for the whole batch except the tree rows that a causal query
  gets wrong (off-spine rows: a sibling branch among their predecessors), which it then
  computes under the ancestor-only mask of the DDTree paper (§3), in one of two ways:

  - **one call per layer** (the layouts in :data:`ONE_CALL_ISAS`, i.e. every x86 layout vLLM
    0.32 / 0.33 writes: ``vec``, ``vec16``, ``amx``; for bf16 / fp16 caches only from
    :data:`LOW_PRECISION_ONE_CALL_MIN_ROWS` tree rows on): one batched float32 attention for
    all such rows of all requests, over each request's cache blocks, read once
    (the body of :func:`~vllm_ddtree.attention.paged.attend_paged_heads`, its indices planned
    once per step), rounded once to the cache dtype.
    Reading the context once per request instead of once per chain is what makes large trees
    affordable. No method rounds a tree row bit-identically to a decode row: vLLM's kernel
    itself moves a row in the last bits with the call's shape (query length, the other
    requests, split-KV scheduling).
  - **chain by chain** (any other layout, whose bytes the plugin does not read, and small bf16
    / fp16 trees): vLLM's own kernel, one causal query per chain (a root→leaf path suffix,
    :func:`tree_chains`) over the path laid out contiguously in the tree's KV slots; every
    chain re-reads the context.

  The torch :func:`vllm_ddtree.attention.paged.tree_attention_reference` is the test oracle.
  This plays the role of the removed ``tree_attn.py``'s ``qq_bias`` path (vLLM PR #20401,
  removed by #42121) with a per-request mask.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass

import numpy as np
import torch
from vllm import envs
from vllm.v1.attention.backend import AttentionLayer, AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
)

from vllm_ddtree import integration
from vllm_ddtree.attention.common import (
    TreeAttentionBatch,
    TreeAttentionRequest,
    active_tree_batch,
)
from vllm_ddtree.attention import paged
from vllm_ddtree.attention.paged import (
    VERIFIED_ISAS,
    _attend_blocks,
    _check_layout_supported,
    _paged_head_rows,
    gather_paged_kv,
)

__all__ = ["DDTreeCPUAttentionBackend", "DDTreeCPUAttentionImpl",
           "LOW_PRECISION_ONE_CALL_MIN_ROWS", "ONE_CALL_ISAS", "off_spine_rows", "tree_chains"]

#: CPU attention ISAs (``layer.isa``, vLLM's ``_get_attn_isa``) whose tree rows can be recomputed
#: in one float32 call per layer over the cache blocks; any other goes chain by chain through
#: vLLM's kernel.
ONE_CALL_ISAS: tuple[str, ...] = VERIFIED_ISAS

#: bf16 / fp16 caches take the one-call path only for steps whose largest tree has at least this
#: many rows (float32 caches always do): the call converts the gathered blocks to float32, which
#: small trees do not repay. Measured in the engine (``benchmarks/e2e.py`` part 2: Qwen3-0.6B's
#: shape, 28 layers, bf16, an 800-token prompt, the random drafter's trees), tree attention per
#: step one call / chain by chain: B = 16 28 / 17.5 ms, B = 32 51 / 54 ms, B = 64 83 / 121 ms.
LOW_PRECISION_ONE_CALL_MIN_ROWS = 33

#: vLLM's CPU op wrappers (moved from ``vllm._custom_ops`` to ``vllm._cpu_ops`` in 0.34).
ops = integration.cpu_ops()
#: KV cache dtypes that are not quantized (0.34 dropped the impl's ``is_fp8_kv_cache``).
_UNQUANTIZED_KV = ("auto", "bfloat16", "float16", "float32")


def off_spine_rows(ancestor_mask: torch.Tensor) -> torch.Tensor:
    """The rows of a draft tree that a causal query over the tree's rows gets wrong.

    Row ``i`` of a causal query sees rows ``0 … i``; that is its ancestor-or-self set exactly
    when ``i`` lies on the tree's first root-to-leaf path in node order (the spine: nodes
    ``0 … i`` are ``i``'s ancestors). Every other row has a sibling branch among its
    predecessors and must be recomputed under the ancestor mask.

    Args:
        ancestor_mask: ``[n, n]`` bool (any device), row ``i`` true at ``j`` iff ``j`` is ``i`` or
            an ancestor of ``i``, as in :class:`~vllm_ddtree.attention.common.TreeAttentionRequest`.

    Returns:
        ``[k]`` long (CPU), increasing: the rows whose mask row differs from the causal row.

    Raises:
        ValueError: ``ancestor_mask`` is not ``[n, n]`` with ``n >= 1``, or not an
            ancestor-or-self mask in topological order (a row missing itself, or seeing a later
            row).
    """
    _, need = _padded_off_spine([ancestor_mask])
    return torch.from_numpy(need[0].nonzero()[0]).to(torch.long)


def _padded_off_spine(masks: list[torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """:func:`off_spine_rows` for several trees at once, padded to the largest (numpy: the
    arrays are small and a step builds them once, where torch's per-op cost dominated).

    Returns:
        ``(A, need)``: ``A`` ``[R, n, n]`` bool the masks (zero-padded), ``need`` ``[R, n]``
        bool the off-spine rows (false on padding).

    Raises:
        ValueError: see :func:`off_spine_rows`.
    """
    sizes = []
    for mask in masks:
        if mask.dim() != 2 or mask.shape[0] != mask.shape[1] or mask.shape[0] < 1:
            raise ValueError(f"ancestor_mask must be [n, n] with n >= 1, got {tuple(mask.shape)}")
        sizes.append(mask.shape[0])
    n = max(sizes)
    if len(masks) == 1:
        a = masks[0].to("cpu", torch.bool).numpy()[None]
    else:
        a = np.zeros((len(masks), n, n), dtype=bool)
        for t, mask in enumerate(masks):
            a[t, : sizes[t], : sizes[t]] = mask.to("cpu", torch.bool).numpy()
    real = np.arange(n) < np.asarray(sizes)[:, None]  # [R, n]
    if (a & _strict_upper(n)).any() or (a.diagonal(axis1=1, axis2=2) != real).any():
        raise ValueError("ancestor_mask is not an ancestor-or-self mask in topological order "
                         "(every row must see itself and only earlier rows)")
    # Row i sees only itself and earlier rows, so it is the causal row iff it sees all i + 1.
    return a, (a.sum(2) != np.arange(1, n + 1)) & real


@functools.lru_cache(maxsize=64)
def _strict_upper(n: int) -> np.ndarray:
    """``[n, n]`` bool, true above the diagonal (read-only: shared between calls)."""
    upper = np.triu(np.ones((n, n), dtype=bool), 1)
    upper.flags.writeable = False
    return upper


@dataclass
class _TreeRowPlan:
    """A step's tree-row recomputation for one attention-metadata object (all layers share it).

    ``R`` requests with off-spine rows, at most ``k`` such rows each, ``G = g * k`` query rows
    per KV head (``g = num_heads // num_kv_heads``; row ``gi * k + i`` is head ``gi`` of the
    group, off-spine row ``i``), ``m`` cache blocks read per request (``S = m * block_size``
    keys). Everything is index arithmetic done once, so a layer runs a fixed handful of ops.

    ``chunks``: one ``(query_index, kv_rows, bias, shape)`` per group of requests gathered
    together (:data:`~vllm_ddtree.attention.paged.GATHER_CHUNK_BYTES`). ``query_index``: long,
    rows of the query viewed ``[num_tokens * num_heads, head_size]``, in ``shape`` order
    (padding repeats the request's first off-spine row); ``shape`` ``(c, Hkv, m, G, D)`` on the
    matmul path (the rows repeated for each block) or ``(c, Hkv, G, D)``. ``kv_rows``: ``[2 * c
    * Hkv * m]`` long, the cache rows of the keys then of the values
    (:func:`~vllm_ddtree.attention.paged.paged_head_rows`; entries past a request's own blocks
    are masked out; ``m`` is ``num_blocks``). ``bias``: float32, the ancestor-only mask as
    ``0`` / ``-inf`` (context keys, then the ancestor-or-self tree keys), ``[c, 1, G, S]``.
    ``result_index``: ``[q]`` long positions of the real rows among the ``R * Hkv * G`` results
    (``None`` when there is no padding); ``rows``: ``[q]`` long their rows in the output viewed
    ``[num_tokens * num_heads, head_size]``.
    """

    chunks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, ...]]]
    result_index: torch.Tensor | None
    rows: torch.Tensor
    num_blocks: int


@dataclass
class _SpinePlan:
    """vLLM's forward without the off-spine tree rows, for one attention-metadata object.

    ``metadata``: ``attn_metadata`` with every cut request's query and ``seq_len`` shortened by
    its off-spine rows (and ``scheduler_metadata`` rebuilt for them); ``keep``: ``[q]`` long, the
    rows of the full query that the shortened one holds, in order, or ``None`` when they are the
    first ``q`` rows.
    """

    metadata: CPUAttentionMetadata
    keep: torch.Tensor | None


def tree_chains(ancestor_mask: torch.Tensor) -> list[tuple[list[int], int]]:
    """Cut a draft tree into the chains :class:`DDTreeCPUAttentionImpl` recomputes.

    Args:
        ancestor_mask: ``[n, n]`` bool (any device), row ``i`` true at ``j`` iff ``j`` is ``i``
            or an ancestor of ``i``, nodes in topological order (root ``0``, parents before
            children), as in :class:`~vllm_ddtree.attention.common.TreeAttentionRequest`.

    Returns:
        ``[(path, first), ...]``: ``path`` lists the nodes root→leaf (``path[p]`` is the node at
        depth ``p``), ``path[first:]`` are the chain's nodes. Only rows whose ancestor set is not
        ``{0 … i}`` are covered (each exactly once); leaves are taken deepest first (ties by
        index), each chain being the part of its root→leaf path not covered by earlier chains,
        so a chain is always a path suffix. Empty if the causal order is already right for every
        row (a chain-shaped tree).

    Raises:
        ValueError: ``ancestor_mask`` is not the ancestor-or-self mask of a tree in topological
            order.
    """
    mask = ancestor_mask.to("cpu", torch.bool)
    n = mask.shape[0]
    if mask.dim() != 2 or mask.shape[1] != n or n < 1:
        raise ValueError(f"ancestor_mask must be [n, n] with n >= 1, got {tuple(mask.shape)}")
    idx = torch.arange(n)
    eye = torch.eye(n, dtype=torch.bool)
    parent = torch.where(mask & ~eye, idx, -1).amax(1)
    depth = mask.sum(1) - 1
    ok = bool(mask[0].eq(idx == 0).all()) and bool(mask.triu(1).logical_not().all())
    if ok and n > 1:
        ok = bool((parent[1:] >= 0).all()) and torch.equal(mask[1:], mask[parent[1:]] | eye[1:])
    if not ok:
        raise ValueError("ancestor_mask is not the ancestor-or-self mask of a tree in "
                         "topological order")
    need = (depth != idx).tolist()
    if not any(need):
        return []
    parent_l, depth_l = parent.tolist(), depth.tolist()
    has_child = [False] * n
    for i in range(1, n):
        has_child[parent_l[i]] = True
    leaves = sorted((i for i in range(n) if need[i] and not has_child[i]),
                    key=lambda i: (-depth_l[i], i))
    done = [False] * n
    chains = []
    for leaf in leaves:
        path = [leaf]
        while path[-1] != 0:
            path.append(parent_l[path[-1]])
        path.reverse()
        first = next(p for p, node in enumerate(path) if need[node] and not done[node])
        for node in path[first:]:
            done[node] = True
        chains.append((path, first))
    return chains


@dataclass
class _Wave:
    """One kernel call: the ``t``-th chain of every tree request that has one.

    ``src`` / ``src_local``: ``[w]`` long rows of the K/V to write before the call (into the
    step's flat ``key``/``value``, or into the concatenated tree K/V of a KV-sharing layer);
    ``slots``: ``[w]`` their KV slots. ``rows``: ``[q]`` long flat query/output rows, chain after
    chain. ``query_start_loc`` ``[r + 1]``, ``seq_lens`` ``[r]`` (int32), ``block_table``
    ``[r, max_blocks]``: one causal request per chain; ``scheduler_metadata``: vLLM's
    ``cpu_attn_get_scheduler_metadata`` for them.
    """

    src: torch.Tensor
    src_local: torch.Tensor
    slots: torch.Tensor
    rows: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    scheduler_metadata: torch.Tensor


@dataclass
class _WavePlan:
    """A step's tree-row recomputation for one attention-metadata object (all layers share it).

    ``requests``: the tree requests with rows to recompute (in ``batch.requests`` order);
    ``waves``: the kernel calls in order; ``restore_*``: the writes that put every tree's own
    K/V back in node order afterwards (only slots some wave changed).
    """

    requests: list[TreeAttentionRequest]
    waves: list[_Wave]
    restore_src: torch.Tensor
    restore_src_local: torch.Tensor
    restore_slots: torch.Tensor


def _cached_plan(batch: TreeAttentionBatch, attn_metadata: CPUAttentionMetadata, key: tuple,
                 build):
    """``build()`` once per metadata object and ``key`` (the heads and layout a plan depends on);
    every layer of the forward with the same metadata reuses it from ``batch.backend_cache``."""
    key = (id(attn_metadata), *key)
    hit = batch.backend_cache.get(key)
    if hit is not None and hit[0] is attn_metadata:
        return hit[1]
    plan = build()
    batch.backend_cache[key] = (attn_metadata, plan)  # holds the metadata: its id stays unique
    return plan


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
    :class:`~vllm_ddtree.attention.common.TreeAttentionRequest` get tree attention; all other
    rows are vLLM's kernel's, from a call that leaves out the off-spine rows (vLLM's kernel
    sums a row in an order that moves with the call's shape, as it does whenever the batch
    changes: on Qwen3-0.6B's heads at B = 64 the spine rows moved by at most 2.5e-7 in fp32,
    and three elements by one bf16 rounding step in bf16; the unit tests' shapes keep every bit).

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
                sinks, fp8 KV cache or non-causal attention, or on a layer that shares another
                layer's cache in a KV layout the plugin has not verified (the chain path then
                has to read the tree's K/V back from the cache).
            ValueError: a tree request inconsistent with the batch metadata (rows outside its
                request, ``context_len`` not the root's position, or an ``ancestor_mask`` that
                is not a tree's).
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
        result = self._forward_without_off_spine_rows(
            layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
            output_block_scale, batch)
        if getattr(layer, "isa", None) in ONE_CALL_ISAS and (
                kv_cache.dtype == torch.float32
                or max(req.num_rows for req in batch.requests) >= LOW_PRECISION_ONE_CALL_MIN_ROWS):
            self._attend_tree_rows_at_once(layer, query, kv_cache, attn_metadata, output, batch)
        else:
            self._overwrite_tree_rows(layer, query, key, value, kv_cache, attn_metadata, output,
                                      batch)
        return result

    def _forward_without_off_spine_rows(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: CPUAttentionMetadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None,
        output_block_scale: torch.Tensor | None,
        batch: TreeAttentionBatch,
    ) -> torch.Tensor:
        """vLLM's forward for every row of the batch except the off-spine tree rows, which are
        recomputed afterwards anyway (their rows of ``output`` are left unwritten).

        A tree request whose tree rows end its query keeps its first ``q - k`` rows (the rows
        before the tree and the spine) and its ``seq_len`` shrinks by ``k`` (its off-spine rows):
        row ``j`` of a causal query of length ``q`` over ``S`` keys sees keys ``< S - q + j + 1``,
        and ``S - q`` is unchanged, so every kept row attends the keys it attended in the full
        call (to the kernel's summation order, which moves with the call's shape), and vLLM's
        kernel no longer attends the off-spine rows that would be thrown away (at
        B = 64 on Qwen3-0.6B's shape that was as much arithmetic as their recomputation). The
        query is gathered into a compact tensor (a slice when only the batch's last request is
        cut) and the results written back; the metadata (``dataclasses.replace`` of vLLM's, with
        its scheduler metadata rebuilt for the new lengths) is planned once per step.
        """
        plan = self._spine_plan(batch, attn_metadata, layer, query.dtype, query.device)
        if plan is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        if plan.keep is None:  # the kept rows are a prefix; vLLM's forward slices to it
            super().forward(layer, query, key, value, kv_cache, plan.metadata, output,
                            output_scale, output_block_scale)
            return output
        # key / value are read by vLLM's forward only for encoder attention (not tree rows).
        res = output.new_empty((plan.keep.numel(), *output.shape[1:]))
        super().forward(layer, query.index_select(0, plan.keep), key, value, kv_cache,
                        plan.metadata, res, output_scale, output_block_scale)
        output.index_copy_(0, plan.keep, res)
        return output

    def _spine_plan(self, batch: TreeAttentionBatch, attn_metadata: CPUAttentionMetadata,
                    layer: AttentionLayer, dtype: torch.dtype,
                    device: torch.device) -> "_SpinePlan | None":
        """This step's :class:`_SpinePlan` for ``attn_metadata`` (cached in ``batch``); ``None``
        when no tree has off-spine rows at the end of its request's query."""
        isa = getattr(layer, "isa", None)
        if isa is None:
            raise ValueError("attention layer has no 'isa' (set by CPUAttentionMetadataBuilder)")
        key = ("cpu_spine", isa, dtype, str(device), self.num_heads, self.num_kv_heads,
               self.head_size, self.kv_cache_dtype, bool(envs.VLLM_CPU_ATTN_SPLIT_KV))
        return _cached_plan(batch, attn_metadata, key, lambda: self._build_spine_plan(
            batch, attn_metadata, isa, dtype, device))

    def _build_spine_plan(self, batch, attn_metadata, isa, dtype, device):
        # Plain Python: a handful of numbers per request, where each torch / numpy op costs µs.
        _, need = self._checked_off_spine(batch, attn_metadata)
        qsl = attn_metadata.query_start_loc.tolist()
        seq_lens = attn_metadata.seq_lens.tolist()
        lens = [hi - lo for lo, hi in zip(qsl, qsl[1:])]
        first_cut = len(lens)
        for req, count in zip(batch.requests, need.sum(1).tolist()):
            b = req.batch_index
            # Only a tree that ends its request's query: later rows would lose keys.
            if count and req.query_start + req.num_rows == qsl[b + 1]:
                lens[b] -= count
                seq_lens[b] -= count
                first_cut = min(first_cut, b)
        if first_cut == len(lens):
            return None
        new_qsl = [0, *itertools.accumulate(lens)]
        if first_cut < len(lens) - 1:  # rows of later requests move down
            shift = np.repeat(np.subtract(qsl[:-1], new_qsl[:-1]), lens)
            keep = torch.from_numpy(np.arange(new_qsl[-1]) + shift).to(device)
        else:  # only the last request is cut: its kept rows and all before are a prefix
            keep = None
        query_start_loc = torch.tensor(new_qsl, dtype=attn_metadata.query_start_loc.dtype,
                                       device=attn_metadata.query_start_loc.device)
        seq_lens_t = torch.tensor(seq_lens, dtype=attn_metadata.seq_lens.dtype,
                                  device=attn_metadata.seq_lens.device)
        metadata = dataclasses.replace(
            attn_metadata, num_actual_tokens=new_qsl[-1], max_query_len=max(lens),
            query_start_loc=query_start_loc, seq_lens=seq_lens_t, max_seq_len=max(seq_lens),
            scheduler_metadata=ops.cpu_attn_get_scheduler_metadata(
                num_reqs=len(lens), num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                head_dim=self.head_size, seq_lens=seq_lens_t, dtype=dtype,
                query_start_loc=query_start_loc, causal=attn_metadata.causal,
                sliding_window_size=-1, isa=isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
                dynamic_causal=attn_metadata.dynamic_causal, kv_cache_dtype=self.kv_cache_dtype,
            ),
        )
        return _SpinePlan(metadata=metadata, keep=keep)

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
        if self.kv_cache_dtype not in _UNQUANTIZED_KV:
            unsupported.append(f"fp8 KV cache ({self.kv_cache_dtype})")
        if not attn_metadata.causal and attn_metadata.dynamic_causal is None:
            unsupported.append("non-causal attention metadata")
        if unsupported:
            raise NotImplementedError(
                "DDTree tree attention on CPU does not support " + ", ".join(unsupported)
                + " on tree rows"
            )

    def _attend_tree_rows_at_once(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: CPUAttentionMetadata,
        output: torch.Tensor,
        batch: TreeAttentionBatch,
    ) -> None:
        """Layouts in :data:`ONE_CALL_ISAS` (bf16 / fp16: large trees): recompute every
        off-spine tree row in one call.

        A row whose ancestor-or-self set is ``{0 … i}`` (the root and a spine prefix) already got
        the right result from vLLM's causal kernel and keeps its bits. All other rows of all
        tree requests are recomputed in **one** batched attention (the body of
        :func:`~vllm_ddtree.attention.paged.attend_paged_heads`, every index precomputed in
        the plan, so a layer runs a fixed handful of torch ops per chunk of requests: the
        query's and the cache's gathers, two ``bmm`` with the mask's add and the softmax between
        them (one SDPA call for rows past the matmul path), the float32 conversions and the
        output's ``index_copy_``): each request's cache blocks
        (committed context and this step's tree K/V, already written by
        :meth:`do_kv_cache_update`, so a layer sharing another layer's cache needs nothing else)
        are read once, and every off-spine row attends to the context and its ancestor-or-self
        nodes under an additive ``0`` / ``-inf`` mask; the query heads of one KV head are folded
        into its rows so each KV head is read once.

        The plan (blocks, query rows, mask) depends only on the trees and this step's
        attention metadata, so it is built once per forward and cached in
        ``batch.backend_cache`` for every layer with the same metadata object, heads and cache
        layout.

        Rounding: torch computes these rows in float32 from the cache's values and rounds each
        element once to the cache dtype; vLLM's kernel (float32 arithmetic too, another
        summation order) lands ~1e-7 relative away, and itself moves a row by as much with the
        call's shape (query length, the other requests of the call, split-KV scheduling). In
        bf16 that is one ulp in a few elements of some rows: measured against vLLM's kernel run
        as a one-token decode over each row's ancestor path (``benchmarks/tree_row_rounding.py``:
        Qwen3-0.6B's heads, trees of 64 and 16 nodes), 5.8e-4 of the elements differ (328 of
        480 rows have one), where the chain-by-chain rows, i.e. vLLM's own chain-verification
        rounding, differ in 3.0e-4 (203 of 480 rows); both by at most 0.63 ε of the row's
        largest element. The ancestor mask is exact.
        """
        isa = getattr(layer, "isa", None)
        if isa is None:
            raise ValueError("attention layer has no 'isa' (set by CPUAttentionMetadataBuilder)")
        plan = self._tree_row_plan(batch, attn_metadata, kv_cache, isa)
        if plan is None:
            return
        head_size = query.shape[-1]
        num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
        cache_rows = kv_cache.view(num_blocks * num_kv_heads * 2, block_size * head_size)
        flat_query = query.reshape(-1, head_size)  # a view unless the query is strided
        res = [_attend_blocks(flat_query.index_select(0, query_index).view(shape).float(),
                              cache_rows, kv_rows, bias, self.scale, isa, plan.num_blocks,
                              block_size)
               for query_index, kv_rows, bias, shape in plan.chunks]
        res = (res[0] if len(res) == 1 else torch.cat(res)).reshape(-1, head_size)
        if plan.result_index is not None:
            res = res.index_select(0, plan.result_index)
        # vLLM's kernel, which wrote the other rows, takes a contiguous output too.
        output.view(-1, head_size).index_copy_(0, plan.rows, res.to(output.dtype))

    def _tree_row_plan(self, batch: TreeAttentionBatch, attn_metadata: CPUAttentionMetadata,
                       kv_cache: torch.Tensor, isa: str) -> "_TreeRowPlan | None":
        """This step's :class:`_TreeRowPlan` for ``attn_metadata`` (cached in ``batch``).

        Raises:
            ValueError / NotImplementedError: see :meth:`forward` (checked when the plan is
                built, i.e. once per metadata object, head configuration and cache layout).
        """
        _, num_kv_heads, block_size, two_d = kv_cache.shape
        key = ("cpu_tree_rows", isa, kv_cache.dtype, block_size, two_d, str(kv_cache.device),
               self.num_heads, num_kv_heads)
        return _cached_plan(batch, attn_metadata, key, lambda: self._build_tree_row_plan(
            batch, attn_metadata, kv_cache, isa))

    def _build_tree_row_plan(self, batch, attn_metadata, kv_cache, isa):
        _, num_kv_heads, block_size, two_d = kv_cache.shape
        head_size = two_d // 2
        if num_kv_heads != self.num_kv_heads or head_size != self.head_size:
            raise ValueError(f"kv_cache {tuple(kv_cache.shape)} does not fit {self.num_kv_heads} "
                             f"KV heads of {self.head_size}")
        _check_layout_supported(isa, kv_cache.dtype, block_size, head_size)
        a, need = self._checked_off_spine(batch, attn_metadata)
        count = need.sum(1)
        todo = count.nonzero()[0]
        if todo.size == 0:
            return None
        if todo.size < count.size:
            a, need, count = a[todo], need[todo], count[todo]
        reqs = [batch.requests[t] for t in todo.tolist()]
        r, n = a.shape[:2]
        k = int(count.max())
        ctx = np.array([req.context_len for req in reqs])
        size = np.array([req.num_rows for req in reqs])
        m = int(((ctx + size + block_size - 1) // block_size).max())
        seq = m * block_size
        # Each request's off-spine rows first, in order; padding repeats its first one.
        order = np.argsort(~need, axis=1, kind="stable")[:, :k]
        valid = np.arange(k) < count[:, None]  # [r, k]
        padded = not valid.all()
        node = np.where(valid, order, order[:, :1]) if padded else order
        tree_rows = a[np.arange(r)[:, None], node]  # [r, k, n]
        # Tree key j of request t sits at column ctx[t] + j; padding columns (j >= size[t]) go
        # to a spare last column, dropped after.
        cols = np.where(np.arange(n) < size[:, None], ctx[:, None] + np.arange(n), seq)
        mask = np.zeros((r, k, seq + 1), dtype=bool)
        mask[np.arange(r)[:, None, None], np.arange(k)[None, :, None], cols[:, None, :]] = tree_rows
        mask = mask[:, :, :-1]
        mask |= (np.arange(seq) < ctx[:, None])[:, None, :]  # context keys: [r, k, S]
        # Query row (t, h, gi, i): token query_start[t] + node[t, i], head h * g + gi, i.e. row
        # token * num_heads + head of the query viewed [num_tokens * num_heads, head_size].
        g = self.num_heads // num_kv_heads
        tokens = np.array([req.query_start for req in reqs])[:, None] + node  # [r, k]
        heads = np.arange(num_kv_heads)[:, None] * g + np.arange(g)  # [Hkv, g]
        rows = (tokens[:, None, None, :] * self.num_heads
                + heads[None, :, :, None]).reshape(r, num_kv_heads, g * k)
        matmul = g * k <= paged.MATMUL_MAX_ROWS
        # The matmul path repeats the rows for each block (see _attend_blocks).
        flat = np.repeat(rows[:, :, None], m, axis=2) if matmul else rows  # [r, Hkv, (m,) G]
        bias = np.repeat(np.where(mask, np.float32(0), np.float32(-np.inf))[:, None], g,
                         axis=1).reshape(r, 1, g * k, seq)  # row gi * k + i
        table = attn_metadata.block_table.to("cpu").numpy()
        table = table[[req.batch_index for req in reqs], :m]  # past a request: masked
        key_rows = _paged_head_rows(table, num_kv_heads).reshape(r, -1)
        per_request = 2 * num_kv_heads * seq * head_size * 4  # float32 keys + values
        chunk = max(1, paged.GATHER_CHUNK_BYTES // per_request)
        device = kv_cache.device
        chunks = []
        for lo in range(0, r, chunk):
            hi = min(r, lo + chunk)
            kv_rows = np.concatenate([key_rows[lo:hi].reshape(-1), key_rows[lo:hi].reshape(-1) + 1])
            shape = ((hi - lo, num_kv_heads, m, g * k, head_size) if matmul
                     else (hi - lo, num_kv_heads, g * k, head_size))
            chunks.append((torch.from_numpy(flat[lo:hi].reshape(-1)).to(device),
                           torch.from_numpy(kv_rows).to(device),
                           torch.from_numpy(bias[lo:hi]).to(device), shape))
        if padded:  # the real rows among the [r, Hkv, G] results
            real = np.broadcast_to(valid[:, None, None], (r, num_kv_heads, g, k)).reshape(-1)
            result_index = torch.from_numpy(real.nonzero()[0]).to(device)
            rows = rows.reshape(-1)[real]
        return _TreeRowPlan(
            chunks=chunks, result_index=result_index if padded else None,
            rows=torch.from_numpy(rows.reshape(-1)).to(device), num_blocks=m,
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
        """Layouts outside :data:`ONE_CALL_ISAS`, and small bf16 / fp16 trees: recompute
        off-spine tree rows with vLLM's kernel, chain by chain (it needs no knowledge of the
        cache's block layout).

        A row whose ancestor-or-self set is ``{0 … i}`` (the root and a spine prefix) already got
        the right result from vLLM's causal kernel. Every other row is recomputed **with vLLM's
        own kernel** (``ops.cpu_attention_with_kv_cache``) by *chain decomposition*: each tree
        is cut into chains, a chain being the not-yet-recomputed suffix of a root→leaf path
        (deepest leaf first). For a chain, the whole root→leaf path's K/V are written (through
        vLLM's KV writer, only the slots whose content changes) into the request's tree slots
        ``context_len .. context_len + depth`` in path order, and the chain's rows run as one
        causal query over that contiguous path: the row at path position ``p`` sees the prefix
        and path positions ``0 .. p``, i.e. exactly its ancestors and itself. The ``t``-th chain
        of every tree request runs in the same kernel call ("wave"; requests own disjoint
        slots), so a step costs ``max(chains per request)`` kernel calls per layer; afterwards
        the tree's own K/V are written back to the slots that changed (the node-order layout
        the commit step expects).

        The wave plan (index, slot, ``seq_lens``/``query_start_loc``/block-table tensors and
        vLLM's scheduler metadata) depends only on the trees and this step's attention metadata,
        so it is built once per forward and cached in ``batch.backend_cache`` for every layer
        with the same metadata object and head configuration.

        Rounding: each recomputed row is rounded by vLLM's kernel like a row of a causal chain
        query (as the spine rows and vLLM's own chain verification are). In bf16 vLLM's CPU
        kernel does not round a row identically in every call shape (query length, split-KV
        scheduling and the other requests of the call change the last bit of a few elements),
        so no method of computing tree rows is bit-identical to batch-1 target-only decoding in
        general; the ancestor mask itself is exact.
        """
        isa = getattr(layer, "isa", None)
        if isa is None:
            raise ValueError("attention layer has no 'isa' (set by CPUAttentionMetadataBuilder)")
        out = output.view(output.shape[0], self.num_heads, -1) if output.dim() == 2 else output
        plan = self._wave_plan(batch, attn_metadata, isa, query.dtype, query.device)
        if plan is None:
            return
        fresh_kv = (
            key is not None and value is not None and self.kv_sharing_target_layer_name is None
        )
        num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
        key_cache, value_cache = kv_cache.view(
            num_blocks, num_kv_heads, 2 * block_size, -1
        ).chunk(2, dim=2)
        if fresh_kv:
            src_k, src_v = key, value
        else:  # a layer sharing another layer's cache: the tree's K/V are in the cache
            ks, vs = [], []
            for req in plan.requests:
                k, v = gather_paged_kv(
                    key_cache, value_cache, attn_metadata.block_table[req.batch_index],
                    req.context_len + req.num_rows, isa,
                )
                ks.append(k[req.context_len :])
                vs.append(v[req.context_len :])
            src_k, src_v = torch.cat(ks), torch.cat(vs)
        write = CPUAttentionBackendImpl.do_kv_cache_update
        for w in plan.waves:
            if w.src.numel():
                src = w.src if fresh_kv else w.src_local
                write(self, layer, src_k.index_select(0, src), src_v.index_select(0, src),
                      kv_cache, w.slots)
            q = query.index_select(0, w.rows)
            res = torch.empty_like(q)
            ops.cpu_attention_with_kv_cache(
                query=q, key_cache=key_cache, value_cache=value_cache, output=res,
                query_start_loc=w.query_start_loc, seq_lens=w.seq_lens, scale=self.scale,
                causal=True, alibi_slopes=None, sliding_window=-1, block_table=w.block_table,
                softcap=0, scheduler_metadata=w.scheduler_metadata, s_aux=None,
                dynamic_causal=None, k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
                kv_cache_dtype=self.kv_cache_dtype,
            )
            out.index_copy_(0, w.rows, res.to(out.dtype))
        if plan.restore_src.numel():
            src = plan.restore_src if fresh_kv else plan.restore_src_local
            write(self, layer, src_k.index_select(0, src), src_v.index_select(0, src), kv_cache,
                  plan.restore_slots)

    def _wave_plan(self, batch: TreeAttentionBatch, attn_metadata: CPUAttentionMetadata,
                   isa: str, dtype: torch.dtype, device: torch.device) -> "_WavePlan | None":
        """This step's :class:`_WavePlan` for ``attn_metadata`` (cached in ``batch``).

        Raises:
            ValueError / NotImplementedError: see :meth:`forward` (checked when the plan is
                built, i.e. once per metadata object and head configuration).
        """
        key = ("cpu_waves", isa, dtype, str(device), self.num_heads, self.num_kv_heads,
               self.head_size, self.kv_cache_dtype, bool(envs.VLLM_CPU_ATTN_SPLIT_KV))
        return _cached_plan(batch, attn_metadata, key, lambda: self._build_wave_plan(
            batch, attn_metadata, isa, dtype, device))

    def _build_wave_plan(self, batch, attn_metadata, isa, dtype, device) -> "_WavePlan | None":
        self._checked_off_spine(batch, attn_metadata)
        slots_all = attn_metadata.slot_mapping.to("cpu")
        todo: list[tuple[TreeAttentionRequest, int, list[list[int]]]] = []
        local = 0  # offset of the request's rows in the concatenated tree K/V (shared-KV layers)
        for req in batch.requests:
            paths = tree_chains(req.ancestor_mask)
            if paths:
                todo.append((req, local, paths))
                local += req.num_rows
        if not todo:
            return None

        long = dict(dtype=torch.long, device=device)
        i32 = attn_metadata.seq_lens.dtype
        waves = []
        content = {id(req): list(range(req.num_rows)) for req, _, _ in todo}  # node in each slot
        for t in range(max(len(p) for _, _, p in todo)):
            src, src_local, slots, rows, qsl, lens, tables = [], [], [], [], [0], [], []
            for req, off, paths in todo:
                if t >= len(paths):
                    continue
                path, first = paths[t]
                cur = content[id(req)]
                for p, node in enumerate(path):
                    if cur[p] != node:
                        cur[p] = node
                        src.append(req.query_start + node)
                        src_local.append(off + node)
                        slots.append(int(slots_all[req.query_start + p]))
                rows += [req.query_start + node for node in path[first:]]
                qsl.append(qsl[-1] + len(path) - first)
                lens.append(req.context_len + len(path))
                tables.append(req.batch_index)
            w_qsl = torch.tensor(qsl, dtype=attn_metadata.query_start_loc.dtype, device=device)
            w_lens = torch.tensor(lens, dtype=i32, device=device)
            waves.append(_Wave(
                src=torch.tensor(src, **long), src_local=torch.tensor(src_local, **long),
                slots=torch.tensor(slots, dtype=attn_metadata.slot_mapping.dtype, device=device),
                rows=torch.tensor(rows, **long), query_start_loc=w_qsl, seq_lens=w_lens,
                block_table=attn_metadata.block_table[torch.tensor(tables, **long)],
                scheduler_metadata=ops.cpu_attn_get_scheduler_metadata(
                    num_reqs=len(lens), num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                    head_dim=self.head_size, seq_lens=w_lens, dtype=dtype, query_start_loc=w_qsl,
                    causal=True, sliding_window_size=-1, isa=isa,
                    enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=None,
                    kv_cache_dtype=self.kv_cache_dtype,
                ),
            ))
        src, src_local, slots = [], [], []
        for req, off, _ in todo:
            for p, node in enumerate(content[id(req)]):
                if node != p:
                    src.append(req.query_start + p)
                    src_local.append(off + p)
                    slots.append(int(slots_all[req.query_start + p]))
        return _WavePlan(
            requests=[req for req, _, _ in todo], waves=waves,
            restore_src=torch.tensor(src, **long), restore_src_local=torch.tensor(src_local, **long),
            restore_slots=torch.tensor(slots, dtype=attn_metadata.slot_mapping.dtype,
                                       device=device),
        )

    def _checked_off_spine(self, batch: TreeAttentionBatch,
                           attn_metadata: CPUAttentionMetadata) -> tuple[np.ndarray, np.ndarray]:
        """Every tree request checked against ``attn_metadata``, then :func:`_padded_off_spine`
        of their masks (``(A, need)``, rows in ``batch.requests`` order); once per metadata
        object, shared by the step's plans.

        Raises:
            ValueError / NotImplementedError: see :meth:`forward`.
        """
        def build():
            query_start_loc = attn_metadata.query_start_loc.tolist()
            seq_lens = attn_metadata.seq_lens.tolist()
            dynamic_causal = attn_metadata.dynamic_causal
            for req in batch.requests:
                self._check_request(req, query_start_loc, seq_lens,
                                    attn_metadata.num_actual_tokens)
                if dynamic_causal is not None and not bool(dynamic_causal[req.batch_index]):
                    raise NotImplementedError(
                        "DDTree tree attention on CPU does not support non-causal attention on "
                        f"tree rows (request {req.batch_index})"
                    )
            return _padded_off_spine([req.ancestor_mask for req in batch.requests])
        return _cached_plan(batch, attn_metadata, ("cpu_off_spine",), build)

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
