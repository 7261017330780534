"""Pure-torch tree attention over vLLM's CPU paged KV cache.

Free of vLLM imports, so the readers also serve as test oracles:

* :func:`tree_attention_reference` -- the ancestor-only attention of the DDTree paper (§3,
  "tree attention": a node sees the committed prefix, its ancestors and itself), computed
  densely in float32. The removed ``vllm/v1/attention/backends/tree_attn.py`` expressed the same
  pattern as an additive ``[-inf, 0]`` bias on the in-window block (``_prepare_tree_attn_bias``);
  here it is a boolean mask, one per request.
* :func:`gather_paged_kv` -- reads a request's first ``num_tokens`` keys/values back out of the
  cache written by ``vllm._custom_ops.cpu_attn_reshape_and_cache`` (vLLM 0.32,
  ``vllm/v1/attention/backends/cpu_attn.py``). The block-interior layout depends on the ISA
  string the CPU backend picked (``layer.isa``); only the layouts verified against that writer are
  read (see :data:`VERIFIED_ISAS`), anything else raises ``NotImplementedError``.
* :func:`attend_paged_heads` -- attention of several requests' rows over whole cache blocks,
  each block read once, computed in float32 (the CPU backend's tree rows run its body,
  ``_attend_blocks``, on indices planned once per step).

Layouts (per block ``b`` and KV head ``h``; the cache tensor is ``[num_blocks, num_kv_heads,
block_size, 2 * head_size]``, viewed ``[nb, Hkv, 2 * bs, D]`` and split in halves, so the key part
and the value part of a ``(b, h)`` pair are each ``bs * D`` contiguous elements; ``t`` is the
token's offset in the block, ``d`` the channel):

* ``vec`` / ``vec16``: keys transposed, ``K[t, d]`` at ``d * bs + t``; values row-major,
  ``V[t, d]`` at ``t * D + d``.
* ``amx`` (bf16 only; ``head_size % 32 == 0`` and ``block_size % 32 == 0``, the only case vLLM's
  ``_get_attn_isa`` picks it): keys in 16-token tiles of channel pairs,
  ``K[16 * g + r, 2 * p + e]`` at ``((g * D / 2 + p) * 16 + r) * 2 + e``; values in 16-channel
  tiles of token pairs, ``V[2 * q + e, 16 * c + r]`` at ``((c * bs / 2 + q) * 16 + r) * 2 + e``.

These were found by writing known values through ``cpu_attn_reshape_and_cache`` (fp32/bf16/fp16
for vec and vec16 over head sizes 32-128 and block sizes 16-128; bf16 for amx over head sizes
32-256 and block sizes 32-128) and locating every element; ``tests/test_tree_attention_cpu.py``
re-checks them against the writer.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

#: ISA strings whose block layout :func:`gather_paged_kv` can read.
VERIFIED_ISAS: tuple[str, ...] = ("vec", "vec16", "amx")

#: :func:`attend_paged_heads` computes up to this many query rows per KV head with explicit
#: matmuls on the cache's ``[D, bs]`` key blocks, and more with one
#: ``scaled_dot_product_attention`` call over transposed keys. Measured per layer on the
#: shipped pair's trees (fp32, 2 KV heads of 64, blocks of 128, 2 cores): at 12-14 rows per head
#: (B = 8) the matmuls take 47 / 134 µs at batch 1 / 5 against 65 / 186 µs (the keys'
#: transpose copy alone was 114 µs at batch 5); at 126 rows (B = 64) 149 against 169 µs at
#: batch 1 but 962 against 857 µs at batch 5, and at 492 rows (B = 256) 885 against 775 µs:
#: large score matrices favour the tiled kernel.
MATMUL_MAX_ROWS = 64

#: :func:`attend_paged_heads` gathers the blocks of as many requests at a time as fit this many
#: bytes as float32 keys and values (at least one request). Measured per layer (2 cores, blocks
#: of 128): Qwen3-0.6B's shape (8 KV heads of 128, context 800, 7.3 MB a request) at batch 8,
#: B = 16 / 64, bf16: all requests at once 30.3 / 74.4 ms, one at a time 18.6 / 54.1 ms (fp32:
#: 31.1 / 74.2 against 19.8 / 52.9); the shipped pair's shape (2 KV heads of 64, context 150,
#: 0.26 MB a request) at batch 8, B = 8: all at once 0.8 ms, one at a time 1.5 ms.
GATHER_CHUNK_BYTES = 4 << 20


def tree_attention_reference(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    context_len: int,
    ancestor_mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Ancestor-only attention for one request's draft tree (DDTree §3).

    Query row ``i`` attends to keys ``0 .. context_len - 1`` (the committed prefix) and to the
    tree key ``context_len + j`` for every ``j`` with ``ancestor_mask[i, j]``. Grouped-query
    attention repeats each KV head for ``H // Hkv`` consecutive query heads (vLLM's convention).
    Computed in float32; no sliding window, ALiBi, soft cap or sinks.

    Args:
        query: ``[n, H, D]`` (any float dtype).
        keys: ``[context_len + n, Hkv, D]``: prefix keys followed by the tree's own keys.
        values: ``[context_len + n, Hkv, Dv]``, same row order as ``keys``.
        context_len: number of committed tokens before the tree's root.
        ancestor_mask: ``[n, n]`` bool; ``[i, j]`` true iff row ``i`` may see tree row ``j``
            (normally ``j`` is ``i`` or an ancestor of ``i``).
        scale: softmax scale (usually ``head_size ** -0.5``).

    Returns:
        ``[n, H, Dv]`` in ``query.dtype``.

    Raises:
        ValueError: inconsistent shapes, ``H % Hkv != 0``, a negative ``context_len``, or a row
            that would see no key at all (empty softmax).
    """
    if query.dim() != 3 or keys.dim() != 3 or values.dim() != 3:
        raise ValueError(
            f"expected query [n, H, D], keys/values [S, Hkv, D]; got {tuple(query.shape)}, "
            f"{tuple(keys.shape)}, {tuple(values.shape)}"
        )
    n, num_heads, head_size = query.shape
    seq_len, num_kv_heads, _ = keys.shape
    if context_len < 0 or seq_len != context_len + n:
        raise ValueError(
            f"keys hold {seq_len} tokens but context_len + n = {context_len} + {n}"
        )
    if keys.shape[2] != head_size or values.shape[:2] != keys.shape[:2]:
        raise ValueError(
            f"keys {tuple(keys.shape)} / values {tuple(values.shape)} do not match query "
            f"{tuple(query.shape)}"
        )
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if tuple(ancestor_mask.shape) != (n, n):
        raise ValueError(f"ancestor_mask is {tuple(ancestor_mask.shape)}, expected ({n}, {n})")

    device = query.device
    tree_mask = ancestor_mask.to(device=device, dtype=torch.bool)
    visible = torch.cat(
        [torch.ones(n, context_len, dtype=torch.bool, device=device), tree_mask], dim=1
    )  # [n, S]
    if n and not bool(visible.any(dim=1).all()):
        raise ValueError("a tree row sees no key (empty ancestor row with context_len == 0)")

    group = num_heads // num_kv_heads
    q = query.to(torch.float32).transpose(0, 1)  # [H, n, D]
    k = keys.to(device=device, dtype=torch.float32).transpose(0, 1)  # [Hkv, S, D]
    v = values.to(device=device, dtype=torch.float32).transpose(0, 1)  # [Hkv, S, Dv]
    if group > 1:
        k = k.repeat_interleave(group, dim=0)
        v = v.repeat_interleave(group, dim=0)
    scores = torch.matmul(q, k.transpose(1, 2)) * float(scale)  # [H, n, S]
    scores = scores.masked_fill(~visible.unsqueeze(0), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v)  # [H, n, Dv]
    return out.transpose(0, 1).to(query.dtype)


def _check_layout_supported(isa: str, dtype: torch.dtype, block_size: int, head_size: int) -> None:
    if isa not in VERIFIED_ISAS:
        raise NotImplementedError(
            f"gather_paged_kv: the KV-cache block layout of CPU attention ISA {isa!r} has not "
            f"been verified (verified: {', '.join(VERIFIED_ISAS)})"
        )
    if dtype in (torch.uint8, torch.int8) or dtype.is_floating_point and dtype.itemsize == 1:
        raise NotImplementedError(
            f"gather_paged_kv: fp8 KV cache ({dtype}) is not supported (no dequantisation)"
        )
    if isa == "amx" and (
        dtype != torch.bfloat16 or head_size % 32 != 0 or block_size % 32 != 0
    ):
        raise NotImplementedError(
            "gather_paged_kv: the 'amx' layout was verified only for bf16 with head_size and "
            f"block_size multiples of 32 (got {dtype}, head_size={head_size}, "
            f"block_size={block_size})"
        )


def gather_paged_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table_row: torch.Tensor,
    num_tokens: int,
    isa: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read the first ``num_tokens`` keys and values of one request from the CPU paged cache.

    Inverts ``vllm._custom_ops.cpu_attn_reshape_and_cache`` for the layouts listed in the module
    docstring: token ``p`` of the request lives in block ``block_table_row[p // bs]`` at offset
    ``p % bs``.

    Args:
        key_cache, value_cache: ``[num_blocks, num_kv_heads, block_size, head_size]`` each, the two
            halves of the CPU backend's cache as ``CPUAttentionBackendImpl`` makes them
            (``kv_cache.view(nb, Hkv, 2 * bs, D).chunk(2, dim=2)``). Logical ``[bs, D]`` indexing
            of these views is *not* ``[token, channel]``; only the raw block memory is used.
        block_table_row: ``[>= ceil(num_tokens / bs)]`` integer block ids of the request.
        num_tokens: how many leading tokens to read (may be 0).
        isa: the ISA string the backend wrote with (``layer.isa``).

    Returns:
        ``(keys, values)``, each ``[num_tokens, num_kv_heads, head_size]`` in the cache dtype
        (fresh tensors, not views of the cache).

    Raises:
        NotImplementedError: an ISA / dtype / shape whose layout was not verified (includes fp8).
        ValueError: ``block_table_row`` too short or bad shapes.
    """
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} must "
            "both be [num_blocks, num_kv_heads, block_size, head_size]"
        )
    _, num_kv_heads, block_size, head_size = key_cache.shape
    _check_layout_supported(isa, key_cache.dtype, block_size, head_size)
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    num_blocks = -(-num_tokens // block_size)
    if block_table_row.numel() < num_blocks:
        raise ValueError(
            f"{num_tokens} tokens need {num_blocks} blocks, block table row has "
            f"{block_table_row.numel()}"
        )
    blocks = block_table_row.reshape(-1)[:num_blocks].to(device=key_cache.device, dtype=torch.long)
    # Advanced indexing copies each selected (block, head) interior into row-major memory, so the
    # reshapes below reinterpret exactly the bytes the writer laid down.
    keys, values = _blocks_head_major(key_cache[blocks][None], value_cache[blocks][None], isa)
    # [1, Hkv, m * bs, D] -> [num_tokens, Hkv, D]
    keys = keys[0, :, :num_tokens].transpose(0, 1)
    values = values[0, :, :num_tokens].transpose(0, 1)
    return keys.contiguous(), values.contiguous()


def paged_head_rows(block_table: torch.Tensor,
                    num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each request's keys and values sit in the CPU cache, for :func:`attend_paged_heads`.

    The cache tensor ``[num_blocks, Hkv, bs, 2 * D]`` viewed as ``[num_blocks * Hkv * 2, bs * D]``
    has one row per ``(block, head, half)``: row ``2 * (b * Hkv + h)`` holds block ``b``'s keys of
    head ``h``, the next row its values (see the module docstring).

    Args:
        block_table: ``[R, m]`` integer block ids (any valid id for padding).
        num_kv_heads: ``Hkv``.

    Returns:
        ``(key_rows, value_rows)``: each ``[R * Hkv * m]`` int64 (on ``block_table``'s device),
        ordered request, head, block.
    """
    key_rows = _paged_head_rows(block_table.to("cpu", torch.long).numpy(), num_kv_heads)
    return (torch.from_numpy(key_rows).to(block_table.device),
            torch.from_numpy(key_rows + 1).to(block_table.device))


def _paged_head_rows(table: np.ndarray, num_kv_heads: int) -> np.ndarray:
    """:func:`paged_head_rows`'s key rows from a numpy ``[R, m]`` block table (numpy: a step
    builds these once, and torch's per-op cost was most of the time)."""
    rows = 2 * (table.astype(np.int64)[:, None, :] * num_kv_heads
                + np.arange(num_kv_heads)[None, :, None])
    return rows.reshape(-1)


def attend_paged_heads(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    key_rows: torch.Tensor,
    value_rows: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
    isa: str,
) -> torch.Tensor:
    """Attention of several requests' query rows over whole blocks of the CPU paged cache.

    Each request's blocks are read once: one ``index_select`` of the key rows and value rows
    of the cache together (:func:`paged_head_rows`); the values are then already token-major
    (``[R, Hkv, S, D]``, no further copy). Up to :data:`MATMUL_MAX_ROWS` rows per KV head the
    scores are one ``bmm`` against the writer's ``[D, bs]`` key blocks (``vec`` / ``vec16`` of
    vLLM's ``cpu_attn_reshape_and_cache``), a softmax and a ``bmm`` with the values; above it
    the keys are transposed to token-major and the attention is one
    ``torch.nn.functional.scaled_dot_product_attention`` call (its CPU kernel tiles the scores,
    which matters at a few hundred tree rows). In the ``amx`` layout (bf16 on CPUs with AMX) the
    keys are stored in tiles, so both keys and values are first unpacked to token-major order.
    Computed in float32 (a bf16 / fp16 cache's blocks are converted after the gather), so for
    those dtypes the caller rounds each result element once. Requests are gathered a group at a
    time, as many as fit :data:`GATHER_CHUNK_BYTES` (the cache-resident working set is what
    large contexts at batch 8 were paying for).

    Args:
        query: ``[R, Hkv, G, D]``: ``G`` query rows of request ``r`` per KV head (the caller
            folds the query heads of one KV head into its rows).
        kv_cache: ``[num_blocks, Hkv, bs, 2 * D]``, contiguous, as the CPU backend allocates it.
        key_rows, value_rows: ``[R * Hkv * m]`` int64 from :func:`paged_head_rows` (``m``
            blocks per request; token ``p`` of request ``r`` is in its block ``p // bs``).
        bias: ``[R, 1, G, m * bs]`` float, added to the scaled scores of every KV head: ``0``
            where a row sees token ``p``, ``-inf`` where it does not. Every row must see at least
            one token.
        scale: softmax scale (usually ``head_size ** -0.5``).
        isa: the ISA string the backend wrote with (``layer.isa``).

    Returns:
        ``[R, Hkv, G, D]`` float32.

    Raises:
        NotImplementedError: a layout not verified against vLLM's writer (see
            :data:`VERIFIED_ISAS`), or fp8.
        ValueError: inconsistent shapes or a non-contiguous cache.
    """
    if kv_cache.dim() != 4 or kv_cache.shape[3] % 2 or query.dim() != 4:
        raise ValueError(
            f"kv_cache {tuple(kv_cache.shape)} must be [num_blocks, num_kv_heads, block_size, "
            f"2 * head_size] and query [R, Hkv, G, D]; got query {tuple(query.shape)}"
        )
    num_blocks, num_kv_heads, block_size, two_d = kv_cache.shape
    head_size = two_d // 2
    _check_layout_supported(isa, kv_cache.dtype, block_size, head_size)
    r, hkv, rows_per_head, d = query.shape
    m = key_rows.numel() // max(r * hkv, 1)
    if (hkv != num_kv_heads or d != head_size or not kv_cache.is_contiguous()
            or key_rows.numel() != r * hkv * m or value_rows.shape != key_rows.shape
            or tuple(bias.shape) != (r, 1, rows_per_head, m * block_size)):
        raise ValueError(
            f"query {tuple(query.shape)}, kv_cache {tuple(kv_cache.shape)} (contiguous: "
            f"{kv_cache.is_contiguous()}), key_rows {tuple(key_rows.shape)}, value_rows "
            f"{tuple(value_rows.shape)} and bias {tuple(bias.shape)} do not fit together"
        )
    if r == 0:
        return torch.empty(query.shape, dtype=torch.float32, device=query.device)
    rows = kv_cache.view(num_blocks * num_kv_heads * 2, block_size * head_size)
    query = query.to(torch.float32)
    bias = bias.to(torch.float32)
    if rows_per_head <= MATMUL_MAX_ROWS:  # the matmul path's layout (see _attend_blocks)
        query = query.unsqueeze(2).expand(r, hkv, m, rows_per_head, d).contiguous()
    per_request = 2 * hkv * m * block_size * head_size * 4  # float32 keys + values
    chunk = max(1, GATHER_CHUNK_BYTES // max(per_request, 1))
    n = hkv * m  # cache rows per request and half
    return torch.cat([
        _attend_blocks(query[a:a + chunk], rows,
                       torch.cat([key_rows[a * n:(a + chunk) * n],
                                  value_rows[a * n:(a + chunk) * n]]),
                       bias[a:a + chunk], scale, isa, m, block_size)
        for a in range(0, r, chunk)])


def _attend_blocks(query, rows, kv_rows, bias, scale, isa, m, block_size):
    """:func:`attend_paged_heads` on validated float32 inputs for one group of ``R`` requests.

    ``rows`` is the cache as ``[nb * Hkv * 2, bs * D]``; ``kv_rows`` ``[2 * R * Hkv * m]`` long
    its key rows then its value rows (one gather for both); ``bias`` ``[R, 1, G, S]``. Two
    paths, by the query's rank:

    * matmul (``G <= MATMUL_MAX_ROWS``): ``query`` ``[R, Hkv, m, G, D]`` contiguous, the rows
      repeated for each block, so the scores are one ``bmm`` against the writer's ``[D, bs]`` key
      blocks as they lie (no copy of the keys); the block axis is moved while the mask is
      added, then a softmax and a ``bmm`` with the values, which are token-major already.
    * SDPA: ``query`` ``[R, Hkv, G, D]``.

    Returns ``[R, Hkv, G, D]`` float32.
    """
    matmul = query.dim() == 5
    r, hkv = query.shape[:2]
    rows_per_head, head_size = query.shape[-2:]
    seq = m * block_size
    raw_keys, raw_values = rows.index_select(0, kv_rows).chunk(2)
    if isa == "amx":  # keys in tiles: unpack both halves to token-major first
        keys, values = _blocks_head_major(
            raw_keys.view(r, hkv, m, block_size, head_size).transpose(1, 2),
            raw_values.view(r, hkv, m, block_size, head_size).transpose(1, 2), isa)
        keys, values = keys.float(), values.float()
        if matmul:
            scores = torch.bmm(query[:, :, 0].reshape(r * hkv, rows_per_head, head_size),
                               keys.view(r * hkv, seq, head_size).transpose(1, 2))
            logits = torch.add(bias, scores.view(r, hkv, rows_per_head, seq), alpha=scale)
    else:
        values = raw_values.view(r, hkv, seq, head_size).float()
        key_blocks = raw_keys.view(r, hkv, m, head_size, block_size)
        if matmul:
            scores = torch.bmm(query.view(r * hkv * m, rows_per_head, head_size),
                               key_blocks.float().view(r * hkv * m, head_size, block_size))
            if m == 1:
                logits = torch.add(bias, scores.view(r, hkv, rows_per_head, seq), alpha=scale)
            else:  # [R, Hkv, m, G, bs] -> [R, Hkv, G, m, bs] in the add's write
                logits = torch.empty(r, hkv, rows_per_head, m, block_size, dtype=torch.float32,
                                     device=query.device)
                torch.add(bias.view(r, 1, rows_per_head, m, block_size).transpose(2, 3),
                          scores.view(r, hkv, m, rows_per_head, block_size), alpha=scale,
                          out=logits.transpose(2, 3))
                logits = logits.view(r, hkv, rows_per_head, seq)
        else:  # token-major for SDPA: transposed and converted in one copy
            keys = torch.empty(r, hkv, m, block_size, head_size, dtype=torch.float32,
                               device=query.device)
            keys = keys.copy_(key_blocks.transpose(-1, -2)).view(r, hkv, seq, head_size)
    if matmul:
        probs = torch.softmax(logits, dim=-1).view(r * hkv, rows_per_head, seq)
        return torch.bmm(probs, values.reshape(r * hkv, seq, head_size)).view(
            r, hkv, rows_per_head, head_size)
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=bias, scale=scale)


def _blocks_head_major(k_raw: torch.Tensor, v_raw: torch.Tensor,
                       isa: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack raw blocks ``[R, m, Hkv, bs, D]`` (each ``(block, head)`` interior contiguous, in
    the writer's layout) to ``[R, Hkv, m * bs, D]`` token-major keys and values."""
    r, m, num_kv_heads, block_size, head_size = k_raw.shape
    if isa in ("vec", "vec16"):
        # Keys are [D, bs] per block: transpose inside each block first (a cache-friendly copy),
        # then move the block axis; done in one strided copy this is ~2x slower.
        keys = (k_raw.reshape(r, m, num_kv_heads, head_size, block_size).transpose(-1, -2)
                .contiguous().permute(0, 2, 1, 3, 4))  # [R, Hkv, m, bs, D]
        values = v_raw.permute(0, 2, 1, 3, 4)
    else:  # amx
        keys = (
            k_raw.reshape(r, m, num_kv_heads, block_size // 16, head_size // 2, 16, 2)
            .permute(0, 2, 1, 3, 5, 4, 6)  # [R, Hkv, m, g, r, p, e]
        )
        values = (
            v_raw.reshape(r, m, num_kv_heads, head_size // 16, block_size // 2, 16, 2)
            .permute(0, 2, 1, 4, 6, 3, 5)  # [R, Hkv, m, q, e, c, r]
        )
    shape = (r, num_kv_heads, m * block_size, head_size)
    return keys.reshape(shape).contiguous(), values.reshape(shape).contiguous()
