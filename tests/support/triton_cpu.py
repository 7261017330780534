"""Test-only: run the CUDA tree-attention backend inside a CPU vLLM engine.

With no GPU, the plugin's CUDA path — the Triton backend's impl, the runner writing and clearing
the static tree-mask buffers, KV compaction inside the cache — would never run in an engine.
:func:`triton_backend_on_cpu` registers :class:`TritonOnCPUBackend` (a subclass of
:class:`vllm_ddtree.attention.cuda.DDTreeTritonAttentionBackend`) for ``CPU_ATTN``, so a CPU
engine built inside the context uses vLLM's Triton metadata builder and KV layout and the plugin's
Triton impl, with the tree kernel under Triton's interpreter (``TRITON_INTERPRET=1``). Two things
vLLM runs through its own Triton kernels, which vLLM disables on CPU, are replaced here by torch:
the KV write (``triton_reshape_and_cache_flash``) and non-causal attention (the DFlash
drafter). Every causal decoder batch — prefill included — goes through the tree kernel.

Slow (every Triton program is interpreted in Python): tiny models and a few tokens only.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from vllm.v1.attention.backend import AttentionType

from vllm_ddtree.attention.cuda import DDTreeTritonAttentionBackend, DDTreeTritonAttentionImpl
from vllm_ddtree.attention.paged import tree_attention_reference

__all__ = ["TritonOnCPUBackend", "TritonOnCPUImpl", "triton_backend_on_cpu"]


class TritonOnCPUImpl(DDTreeTritonAttentionImpl):
    """:class:`DDTreeTritonAttentionImpl` with torch stand-ins for vLLM's Triton-only pieces."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.verify_len is not None:
            self.verify_len = 1 << 30  # every causal batch through the tree kernel

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        """vLLM's Triton KV write, in torch: token ``t`` to slot ``slot_mapping[t]`` (< 0: skip)."""
        if self.attn_type in (AttentionType.ENCODER_ONLY, AttentionType.ENCODER):
            return
        key_cache, value_cache = self.nhd_caches(kv_cache)
        n = slot_mapping.shape[0]
        slots = slot_mapping.long()
        keep = slots >= 0
        slots = slots[keep]
        block_size = key_cache.shape[1]
        blk, off = slots // block_size, slots % block_size
        key_cache[blk, off] = key[:n][keep].to(key_cache.dtype)
        value_cache[blk, off] = value[:n][keep].to(value_cache.dtype)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        """The plugin's impl for causal batches; a torch reference for the rest (DFlash)."""
        if attn_metadata is None:
            return output.fill_(0)
        if self._uses_tree_kernel(attn_metadata):
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        if attn_metadata.causal is True:
            raise AssertionError("a causal batch of a target-only engine reached the test backend")
        key_cache, value_cache = self.nhd_caches(kv_cache)
        out = output.view(output.shape[0], self.num_heads, -1)
        qsl = attn_metadata.query_start_loc.tolist()
        seq_lens = attn_metadata.seq_lens.tolist()
        block_size = key_cache.shape[1]
        for r in range(len(seq_lens)):
            lo, hi, s = qsl[r], qsl[r + 1], seq_lens[r]
            if hi == lo:
                continue
            pos = torch.arange(s)
            blk = attn_metadata.block_table[r, pos // block_size].long()
            k, v = key_cache[blk, pos % block_size], value_cache[blk, pos % block_size]
            visible = torch.ones(hi - lo, hi - lo, dtype=torch.bool)  # non-causal block
            out[lo:hi] = tree_attention_reference(query[lo:hi], k, v, s - (hi - lo), visible,
                                                  self.scale).to(out.dtype)
        return output


class TritonOnCPUBackend(DDTreeTritonAttentionBackend):
    """:class:`DDTreeTritonAttentionBackend` with :class:`TritonOnCPUImpl` (test only)."""

    @staticmethod
    def get_impl_cls() -> type[TritonOnCPUImpl]:
        return TritonOnCPUImpl


@contextlib.contextmanager
def triton_backend_on_cpu() -> Iterator[None]:
    """Within the context, CPU engines use :class:`TritonOnCPUBackend` (in-process engines only:
    the registry is per process). The previous ``CPU_ATTN`` registration is restored after.

    Raises:
        RuntimeError: ``TRITON_INTERPRET`` is not ``1`` (the kernel cannot run on CPU tensors).
    """
    import os

    from vllm.v1.attention import selector
    from vllm.v1.attention.backends import registry

    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("TRITON_INTERPRET=1 must be set before triton is imported")
    member = registry.AttentionBackendEnum.CPU_ATTN
    had, previous = member in registry._ATTN_OVERRIDES, registry._ATTN_OVERRIDES.get(member)
    registry.register_backend(member, f"{__name__}.TritonOnCPUBackend")
    selector._cached_get_attn_backend.cache_clear()  # vLLM caches the resolved class
    try:
        yield
    finally:
        if had:
            registry._ATTN_OVERRIDES[member] = previous
        else:
            registry._ATTN_OVERRIDES.pop(member, None)
        selector._cached_get_attn_backend.cache_clear()
