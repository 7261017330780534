"""DDTree tree attention on vLLM's CUDA Triton backend (``TRITON_ATTN``).

vLLM deleted its ``TREE_ATTN`` backend (PR #42121); it had one static ``qq_bias`` tree shared by
the whole batch. This backend is vLLM's own Triton backend
(``vllm/v1/attention/backends/triton_attn.py``: ``TritonAttentionBackend``, metadata builder, KV
layout, KV writer and CUDA-graph support all inherited) whose impl sends the target's
verification batches to :func:`vllm_ddtree.attention.triton_tree.tree_attention_paged`: causal
rows as vLLM computes them, and each request's draft-tree rows under its own ancestor bitmask
(DDTree paper §3). The plugin registers it as ``AttentionBackendEnum.TRITON_ATTN`` on CUDA and
selects ``TRITON_ATTN`` for DDTree engines (:mod:`vllm_ddtree.attention.selection`).

CUDA graphs. A captured graph replays kernels with the tensor addresses of capture time and runs
no Python, so nothing here may depend on Python state at replay:

* the tree masks live in one preallocated :class:`~vllm_ddtree.attention.triton_tree.
  TreeMaskBuffers` per engine (:func:`install_tree_mask_buffers`, from the model runner's
  ``__init__``), written in place by :func:`publish_tree_masks` right before the target's
  forward and reset to "no tree" (``tree_start = -1``) by :func:`clear_tree_masks` right after;
  every other forward (drafter, prefill, warm-up, capture) therefore sees plain causal rows;
* which kernel runs is decided from the batch shape, never from the tree: every causal decoder
  batch whose longest request has at most ``num_speculative_tokens + 1`` rows (all uniform
  decode / verification batches, the only ones vLLM captures as full graphs) uses the tree kernel
  with ``max_query_len`` fixed by the metadata; longer batches use vLLM's ``unified_attention``
  unless trees are published for them (a prefill chunk sharing a step with draft trees, never
  captured as a full graph);
* KV compaction after verification copies slots inside each layer's cache
  (:meth:`DDTreeTritonAttentionImpl.copy_kv_slots`), not from K/V recorded in Python.
"""

from __future__ import annotations

from typing import Any, Collection, Mapping, Sequence

import torch
from vllm.v1.attention.backend import AttentionLayer, AttentionType
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadata,
)

from vllm_ddtree.attention.common import TreeAttentionRequest
from vllm_ddtree.attention.triton_tree import (
    MAX_TREE_ROWS,
    TreeMaskBuffers,
    allocate_tree_mask_buffers,
    build_tree_mask_buffers,
    check_tree_kernel_fits,
    compact_kv_nhd,
    tree_attention_paged,
)

__all__ = [
    "DDTreeTritonAttentionBackend",
    "DDTreeTritonAttentionImpl",
    "allocate_engine_tree_masks",
    "check_cudagraph_mode",
    "clear_tree_masks",
    "install_tree_mask_buffers",
    "installed_tree_mask_buffers",
    "publish_tree_masks",
]

#: The engine's mask buffers (one engine per process on CUDA: vLLM's worker model).
_BUFFERS: TreeMaskBuffers | None = None
#: Whether :func:`publish_tree_masks` wrote trees that :func:`clear_tree_masks` has not cleared.
_PUBLISHED = False


def allocate_engine_tree_masks(max_num_seqs: int, budget: int, device: torch.device | str,
                               max_tree_tokens: int | None = None) -> TreeMaskBuffers:
    """Mask buffers sized for an engine: ``max_num_seqs`` trees of ``budget + 1`` rows each.

    Args:
        max_num_seqs: the scheduler's ``max_num_seqs`` (requests per step).
        budget: node budget B (a tree has at most ``B + 1`` rows).
        device: the model's device.
        max_tree_tokens: tree rows one step can hold at most (the scheduler's
            ``max_num_batched_tokens``); default ``max_num_seqs * (budget + 1)``.

    Raises:
        ValueError: ``budget + 1`` exceeds :data:`~vllm_ddtree.attention.triton_tree.MAX_TREE_ROWS`.
    """
    if budget + 1 > MAX_TREE_ROWS:
        raise ValueError(
            f"speculative_config['ddtree_budget']={budget}: the CUDA tree-attention kernel takes "
            f"trees of at most {MAX_TREE_ROWS} rows (budget <= {MAX_TREE_ROWS - 1})"
        )
    tokens = max_num_seqs * (budget + 1)
    if max_tree_tokens is not None:
        tokens = min(tokens, max_tree_tokens)
    return allocate_tree_mask_buffers(max_num_seqs, tokens, budget + 1, device=device)


def engine_uses_tree_mask_buffers() -> bool:
    """Whether this process's tree-attention backend is :class:`DDTreeTritonAttentionBackend`
    (or a subclass): the backend that :mod:`vllm_ddtree.attention.selection` picks for the
    platform, resolved through vLLM's registry (``TRITON_ATTN`` on CUDA; on CPU only when a test
    registers the Triton backend for ``CPU_ATTN``, :mod:`tests.support.triton_cpu`)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_ddtree.attention.selection import TREE_ATTENTION_BACKENDS, current_platform_name

    name = TREE_ATTENTION_BACKENDS.get(current_platform_name())
    if name is None:
        return False
    try:
        backend = AttentionBackendEnum[name].get_class()
    except (ImportError, ValueError):
        return False
    return isinstance(backend, type) and issubclass(backend, DDTreeTritonAttentionBackend)


def check_cudagraph_mode(mode) -> None:
    """Refuse CUDA-graph modes that capture mixed batches as full graphs.

    The impl picks the tree kernel for a batch longer than ``num_speculative_tokens + 1`` rows
    only while trees are published (Python state); a full graph of a mixed batch would replay the
    choice made at capture, when none were. ``FULL_AND_PIECEWISE`` (vLLM's default),
    ``FULL_DECODE_ONLY``, ``PIECEWISE`` and ``NONE`` capture full graphs of uniform decode
    batches at most, which always run the tree kernel.

    Args:
        mode: ``vllm.config.CUDAGraphMode`` (``compilation_config.cudagraph_mode``) or ``None``.

    Raises:
        DDTreeConfigError: ``mode`` is ``FULL``.
    """
    from vllm_ddtree.config import DDTreeConfigError

    if mode is None:
        return
    if getattr(mode, "mixed_mode", None) and mode.mixed_mode().name == "FULL":
        raise DDTreeConfigError(
            f"compilation_config.cudagraph_mode={mode.name} is not supported with speculative "
            "method 'ddtree' (full graphs of mixed prefill/tree batches); use FULL_AND_PIECEWISE "
            "(the default), FULL_DECODE_ONLY or PIECEWISE"
        )


def install_tree_mask_buffers(buffers: TreeMaskBuffers | None) -> None:
    """Make ``buffers`` the ones every :class:`DDTreeTritonAttentionImpl` reads (or none)."""
    global _BUFFERS, _PUBLISHED
    _BUFFERS, _PUBLISHED = buffers, False


def installed_tree_mask_buffers() -> TreeMaskBuffers | None:
    """The buffers installed by :func:`install_tree_mask_buffers`, or ``None``."""
    return _BUFFERS


def publish_tree_masks(requests: Sequence[TreeAttentionRequest],
                       query_start_loc: Sequence[int], num_reqs: int) -> None:
    """Write this step's draft trees into the installed buffers, in place (before the forward).

    Args:
        requests: the step's tree requests (``TreeAttentionBatch.requests``); ancestor masks
            ``[m, m]`` bool on the model's device.
        query_start_loc: host ints ``[num_reqs + 1]``, the step's row offsets per request.
        num_reqs: requests in the step (the rest of ``tree_start`` is set to ``-1``).

    Raises:
        RuntimeError: no buffers installed.
        ValueError: a tree that does not end at its request's last row (the kernel's layout), a
            request index outside the step, or buffers too small (see
            :func:`~vllm_ddtree.attention.triton_tree.build_tree_mask_buffers`).
    """
    global _PUBLISHED
    if _BUFFERS is None:
        raise RuntimeError("DDTree: no tree-mask buffers installed for the CUDA backend")
    masks: list[torch.Tensor | None] = [None] * num_reqs
    q_lens = [int(query_start_loc[b + 1]) - int(query_start_loc[b]) for b in range(num_reqs)]
    for req in requests:
        b = req.batch_index
        if not 0 <= b < num_reqs:
            raise ValueError(f"tree request batch_index {b} outside the step ({num_reqs})")
        if req.query_start + req.num_rows != int(query_start_loc[b + 1]):
            raise ValueError(
                f"tree request {b}: rows [{req.query_start}, {req.query_start + req.num_rows}) "
                f"do not end at the request's last row {int(query_start_loc[b + 1]) - 1}"
            )
        masks[b] = req.ancestor_mask
    build_tree_mask_buffers(masks, q_lens, out=_BUFFERS, validate=False)
    _PUBLISHED = bool(requests)


def clear_tree_masks() -> None:
    """Mark every request as tree-less (``tree_start = -1``), in place (after the forward)."""
    global _PUBLISHED
    if _BUFFERS is not None:
        _BUFFERS.tree_start.fill_(-1)
    _PUBLISHED = False


class DDTreeTritonAttentionBackend(TritonAttentionBackend):
    """``TRITON_ATTN`` whose impl verifies per-request draft trees.

    Same name (vLLM compares backend names), KV-cache layout, metadata builder and CUDA-graph
    support as vLLM's ``TritonAttentionBackend``; only :meth:`get_impl_cls` differs.
    """

    @staticmethod
    def get_name() -> str:
        return "TRITON_ATTN"

    @staticmethod
    def get_impl_cls() -> type["DDTreeTritonAttentionImpl"]:
        return DDTreeTritonAttentionImpl


def _engine_verify_len() -> int | None:
    """``num_speculative_tokens + 1`` of the DDTree engine being built, else ``None``."""
    from vllm.config.vllm import get_current_vllm_config_or_none

    from vllm_ddtree.config import get_ddtree_config

    cfg = get_current_vllm_config_or_none()  # vLLM builds layers inside set_current_vllm_config
    if cfg is None or get_ddtree_config(cfg) is None or cfg.speculative_config is None:
        return None
    return int(cfg.speculative_config.num_speculative_tokens) + 1


def check_tree_kernel_on_this_gpu(head_size: int, group: int) -> None:
    """Engine start-up: the tree kernel can launch for this layer on this process's GPU.

    A layer whose tiles cannot fit the GPU's shared memory would otherwise stop the engine with
    Triton's ``OutOfResources`` at the first tree step. Nothing to check off CUDA.

    Args:
        head_size: the layer's head size.
        group: query heads per KV head.

    Raises:
        TreeKernelResourceError: no launch configuration fits
            (:func:`~vllm_ddtree.attention.triton_tree.choose_tree_kernel_config`).
    """
    if not torch.cuda.is_available():
        return
    from vllm.config.vllm import get_current_vllm_config_or_none

    cfg = get_current_vllm_config_or_none()
    model_config = getattr(cfg, "model_config", None)
    dtype = getattr(model_config, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        dtype = torch.float32  # the widest: fits whenever any dtype does
    check_tree_kernel_fits(dtype, head_size, group,
                           torch.device("cuda", torch.cuda.current_device()))


class DDTreeTritonAttentionImpl(TritonAttentionImpl):
    """vLLM's ``TritonAttentionImpl`` plus ancestor-only attention for DDTree tree rows.

    Outside a DDTree engine (``verify_len is None``) every method is vLLM's. In a DDTree engine,
    causal decoder self-attention batches of at most ``verify_len`` rows per request (and any
    batch while trees are published) run :func:`tree_attention_paged` over the same paged cache
    with the installed mask buffers (module docstring); everything else is vLLM's.

    Attributes:
        verify_len: ``num_speculative_tokens + 1`` of the engine, read from the vLLM config being
            built when the layer is constructed (``None``: not a DDTree engine).

    Raises:
        TreeKernelResourceError: (construction, DDTree engines on CUDA) the tree kernel has no
            launch configuration within the GPU's shared memory for this layer
            (:func:`check_tree_kernel_on_this_gpu`).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.verify_len = _engine_verify_len()
        if self.verify_len is not None:
            check_tree_kernel_on_this_gpu(self.head_size, self.num_heads // self.num_kv_heads)

    # ------------------------------------------------------------------ attention
    def _uses_tree_kernel(self, attn_metadata: TritonAttentionMetadata | None) -> bool:
        if (
            self.verify_len is None
            or attn_metadata is None
            or self.attn_type != AttentionType.DECODER
            or attn_metadata.causal is not True
            or _BUFFERS is None
        ):
            return False
        return _PUBLISHED or attn_metadata.max_query_len <= self.verify_len

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: TritonAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention for ``query`` over the paged cache; tree rows see only their ancestors.

        Args:
            query: ``[num_tokens, num_heads, head_size]`` (rows past
                ``attn_metadata.num_actual_tokens`` are padding and left untouched).
            key, value: ``[num_tokens, num_kv_heads, head_size]``, already in the cache.
            kv_cache: vLLM's logical ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``
                (any physical layout).
            attn_metadata: ``TritonAttentionMetadata`` (``None`` in profile runs).
            output: ``[num_tokens, num_heads, head_size]``, written in place.

        Returns:
            ``output``.

        Raises:
            NotImplementedError: a tree-kernel batch on a layer with sliding window, ALiBi,
                logits soft cap, sinks, a quantized KV cache, chunked local attention,
                multimodal prefix ranges, fused output quantization, or a head-size split of K/V.
        """
        if not self._uses_tree_kernel(attn_metadata):
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        self._refuse_unsupported(attn_metadata, output_scale, output_block_scale)
        n = attn_metadata.num_actual_tokens
        key_cache, value_cache = self.nhd_caches(kv_cache)
        out = output.view(output.shape[0], self.num_heads, -1) if output.dim() == 2 else output
        tree_attention_paged(
            query[:n], key_cache, value_cache, attn_metadata.block_table,
            attn_metadata.seq_lens, attn_metadata.query_start_loc, _BUFFERS.tree_start,
            _BUFFERS.tree_mask, _BUFFERS.tree_mask_offsets, self.scale, out[:n],
            max_query_len=attn_metadata.max_query_len,
        )
        return output

    def nhd_caches(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value views ``[num_blocks, block_size, num_kv_heads, head_size]`` of the
        logical cache, as vLLM's Triton impl splits it (``transpose(1, 2).split(head_size)``)."""
        return kv_cache.transpose(1, 2).split(self.head_size, dim=-1)

    def _refuse_unsupported(self, attn_metadata, output_scale, output_block_scale) -> None:
        unsupported = []
        if self.sliding_window not in ((-1, -1), None):
            unsupported.append(f"sliding window {self.sliding_window}")
        if self.alibi_slopes is not None:
            unsupported.append("ALiBi")
        if self.logits_soft_cap:
            unsupported.append(f"logits soft cap ({self.logits_soft_cap})")
        if self.sinks is not None:
            unsupported.append("attention sinks")
        if self.kv_cache_dtype not in ("auto", "bfloat16", "float16", "float32"):
            unsupported.append(f"KV cache dtype {self.kv_cache_dtype!r}")
        if self.chunk_lookback != -1:
            unsupported.append("chunked local attention")
        if attn_metadata.mm_prefix_range_tensor is not None:
            unsupported.append("multimodal prefix ranges")
        if attn_metadata.rswa_prefix_lens is not None:
            unsupported.append("restricted sliding window")
        if output_scale is not None or output_block_scale is not None:
            unsupported.append("fused output quantization")
        if unsupported:
            raise NotImplementedError(
                "DDTree tree attention on CUDA does not support " + ", ".join(unsupported)
            )

    # ------------------------------------------------------------------ KV compaction
    def copy_kv_slots(self, kv_cache: torch.Tensor, src_slots: torch.Tensor,
                      dst_slots: torch.Tensor) -> None:
        """KV compaction: copy the K/V at ``src_slots`` onto ``dst_slots`` in this layer's cache.

        Args:
            kv_cache: the layer's logical ``[num_blocks, num_kv_heads, block_size,
                2 * head_size]`` cache (written through, any physical layout).
            src_slots, dst_slots: ``[k]`` int64 on the cache's device, distinct destinations;
                slot = ``block_id * block_size + offset`` (vLLM's slot mapping).
        """
        key_cache, value_cache = self.nhd_caches(kv_cache)
        compact_kv_nhd(key_cache, value_cache, src_slots, dst_slots)


def target_cache_layers(layers: Mapping[str, Any],
                        drafter_layer_names: Collection[str]) -> dict[str, tuple[Any, torch.Tensor]]:
    """The layers whose caches KV compaction on CUDA rewrites (``commit.compact_kv_in_cache``).

    Args:
        layers: ``name -> attention layer`` of the engine (vLLM's static forward context).
        drafter_layer_names: the drafter's attention layers (its cache is not compacted).

    Returns:
        ``name -> (impl, kv_cache)`` of the target's decoder self-attention layers on
        :class:`DDTreeTritonAttentionImpl` that own their cache: KV-sharing layers, and a second
        layer on an already listed cache, are left out (a second copy would read moved slots).
    """
    out: dict[str, tuple[Any, torch.Tensor]] = {}
    seen = set()
    for name, layer in layers.items():
        impl = getattr(layer, "impl", None)
        if (name in drafter_layer_names or not isinstance(impl, DDTreeTritonAttentionImpl)
                or impl.attn_type != "decoder" or impl.kv_sharing_target_layer_name):
            continue
        kv_cache = layer.kv_cache
        if kv_cache.data_ptr() in seen:
            continue
        seen.add(kv_cache.data_ptr())
        out[name] = (impl, kv_cache)
    return out
