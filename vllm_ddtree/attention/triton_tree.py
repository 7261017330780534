"""Per-request tree attention over the CUDA paged KV cache (NHD layout), as a Triton kernel.

vLLM's removed ``TREE_ATTN`` backend verified a tree by calling the Triton
``unified_attention`` kernel (``vllm/v1/attention/ops/triton_unified_attention.py``) with
``qq_bias``: one additive ``[Q, Q]`` bias shared by the whole batch. DDTree builds a different
tree for every request at every step, so this module carries its own kernel whose mask is looked
up per request. Everything else follows the conventions of ``unified_attention``:

* ``query`` / ``output``: ``[num_tokens, num_heads, head_size]``; request ``r`` owns rows
  ``query_start_loc[r] .. query_start_loc[r + 1] - 1``, and its row ``i`` (of ``q_len`` rows) sits
  at position ``seq_lens[r] - q_len + i`` (the request's new tokens are the last ``q_len`` of its
  ``seq_lens[r]`` tokens, and their K/V are already in the cache).
* ``key_cache`` / ``value_cache``: ``[num_blocks, block_size, num_kv_heads, head_size]`` each
  (NHD; any strides, e.g. the two halves ``kv_cache[0]``, ``kv_cache[1]`` of FlashAttention's
  stacked ``[2, num_blocks, block_size, num_kv_heads, head_size]`` cache, or ``unbind(1)`` of
  Triton's ``[num_blocks, 2, block_size, ...]``). Token ``p`` of request ``r`` is at block
  ``block_table[r, p // block_size]``, offset ``p % block_size`` (slot
  ``block_id * block_size + offset``).
* grouped-query attention: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
* softmax in float32 with an online (streaming) softmax over key tiles; ``Q K^T`` and ``P V`` use
  ``tl.dot`` with float32 accumulation (IEEE fp32 products for fp32 inputs, no TF32 by default).

Visibility (per request ``r`` with ``q_len`` rows, ``S = seq_lens[r]``, ``ts = tree_start[r]``):

* ordinary rows (every row when ``ts == -1``, else rows ``i < ts``): causal, key ``j`` visible
  iff ``j <= S - q_len + i`` (prefill chunks and plain decode rows);
* tree rows ``i = ts .. q_len - 1`` (a draft tree of ``q_len - ts = n + 1`` nodes, root first,
  always ending at the request's last row): with ``root = S - q_len + ts`` (the root's position =
  committed context length), key ``j`` is visible iff ``j < root`` (committed prefix) or bit
  ``j - root`` of tree row ``i - ts``'s ancestor bitmask is set (ancestors-or-self). This is
  :func:`vllm_ddtree.attention.paged.tree_attention_reference` per request.

Tree-mask layout (:class:`TreeMaskBuffers`, made by :func:`build_tree_mask_buffers`):

* ``tree_start``: ``[num_reqs]`` int32, first tree row within the request, ``-1`` = no tree;
* ``tree_mask``: flat ``[capacity]`` int32 words. A tree of ``m = n + 1`` rows uses
  ``W = ceil(m / 32)`` words per row, row-major: tree row ``a`` sees tree key ``b`` iff bit
  ``b % 32`` (LSB = bit 0) of word ``tree_mask[tree_mask_offsets[r] + a * W + b // 32]`` is set
  (words are the two's-complement int32 view of the 32-bit pattern). Bits ``b >= m`` are zero;
* ``tree_mask_offsets``: ``[num_reqs]`` int32 word offset of request ``r``'s tree row 0 (ignored
  when ``tree_start[r] == -1``).

A step's trees need ``sum_r m_r * ceil(m_r / 32)`` words, at most
``max_tree_tokens * ceil(max_tree_rows / 32)`` (:func:`max_tree_mask_words`), where
``max_tree_tokens`` bounds the tree rows of one step (e.g. ``max_num_seqs * (B + 1)``) and
``max_tree_rows`` the rows of one tree. Allocate once (:func:`allocate_tree_mask_buffers`) and
rewrite in place every step (``build_tree_mask_buffers(..., out=buffers)``, outside any CUDA-graph
capture: it packs on the masks' device and copies two small host lists). The kernel's inputs then
keep their addresses, so a captured graph can replay it when ``max_query_len`` is passed as a fixed
host int (the launch grid is ``(num_reqs, ceil(max_query_len / BLOCK_Q), num_kv_heads)``; programs
past a request's rows exit at once, and requests with 0 rows are padding).

KV compaction after verification (:func:`compact_kv_nhd`, :func:`compact_kv_stacked`) copies the
accepted nodes' K/V slots onto their committed slots with one gather and one scatter.

Importing this module needs only torch (it never imports vLLM); the kernel needs Triton: a CUDA
GPU, or Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1`` set before this module is
imported and kept set while the kernel runs; there bf16 products are computed in fp32, since
Triton 3.9's interpreter gets bf16 ``tl.dot`` wrong).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from vllm_ddtree.attention.paged import tree_attention_reference

try:  # the torch helpers below work without Triton; only the kernel needs it
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None
    HAS_TRITON = False

#: Largest tree (root + draft nodes) that :func:`build_tree_mask_buffers` accepts. The kernel has
#: no hard limit; this bounds the mask buffer (``ceil(1024 / 32) = 32`` words per tree row).
MAX_TREE_ROWS = 1024
#: Bits per tree-mask word.
MASK_WORD_BITS = 32
#: Query / cache dtypes the kernel accepts (fp8 and other quantised caches are not supported).
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------- mask buffers


@dataclass
class TreeMaskBuffers:
    """The per-request tree masks in the kernel's layout (see the module docstring).

    Attributes:
        tree_start: ``[>= num_reqs]`` int32; ``-1`` = the request has no tree.
        tree_mask: ``[capacity]`` int32 ancestor bitmask words.
        tree_mask_offsets: ``[>= num_reqs]`` int32 word offset of each request's tree row 0.
    """

    tree_start: torch.Tensor
    tree_mask: torch.Tensor
    tree_mask_offsets: torch.Tensor


def mask_words_per_row(num_rows: int) -> int:
    """Words per tree row for a tree of ``num_rows`` (= ``n + 1``) rows: ``ceil(num_rows / 32)``."""
    return -(-num_rows // MASK_WORD_BITS)


def tree_mask_words(num_rows: int) -> int:
    """Words one tree of ``num_rows`` rows occupies: ``num_rows * ceil(num_rows / 32)``."""
    return num_rows * mask_words_per_row(num_rows)


def max_tree_mask_words(max_tree_tokens: int, max_tree_rows: int = MAX_TREE_ROWS) -> int:
    """Static capacity (in words) that holds the masks of any step whose trees have at most
    ``max_tree_tokens`` rows in total and at most ``max_tree_rows`` rows each."""
    if max_tree_tokens < 0 or max_tree_rows < 1:
        raise ValueError(
            f"max_tree_tokens must be >= 0 and max_tree_rows >= 1, got {max_tree_tokens}, "
            f"{max_tree_rows}"
        )
    return max_tree_tokens * mask_words_per_row(min(max_tree_rows, max(max_tree_tokens, 1)))


def allocate_tree_mask_buffers(
    max_num_reqs: int,
    max_tree_tokens: int,
    max_tree_rows: int = MAX_TREE_ROWS,
    device: torch.device | str | None = None,
) -> TreeMaskBuffers:
    """Preallocate mask buffers once; :func:`build_tree_mask_buffers` (``out=``) fills them.

    Returns buffers with ``tree_start`` all ``-1`` (no trees), ``tree_mask`` zeroed.
    """
    if max_num_reqs < 0:
        raise ValueError(f"max_num_reqs must be >= 0, got {max_num_reqs}")
    words = max_tree_mask_words(max_tree_tokens, max_tree_rows)
    return TreeMaskBuffers(
        tree_start=torch.full((max_num_reqs,), -1, dtype=torch.int32, device=device),
        tree_mask=torch.zeros(max(words, 1), dtype=torch.int32, device=device),
        tree_mask_offsets=torch.zeros(max_num_reqs, dtype=torch.int32, device=device),
    )


def _pack_rows(mask: torch.Tensor) -> torch.Tensor:
    """``[m, m]`` bool -> ``[m * ceil(m / 32)]`` int32 words (bit ``b % 32`` of word ``b // 32``)."""
    m = mask.shape[0]
    w = mask_words_per_row(m)
    padded = torch.zeros(m, w * MASK_WORD_BITS, dtype=torch.int64, device=mask.device)
    padded[:, :m] = mask.to(torch.int64)
    weights = torch.ones(MASK_WORD_BITS, dtype=torch.int64, device=mask.device) << torch.arange(
        MASK_WORD_BITS, dtype=torch.int64, device=mask.device
    )
    words = (padded.view(m, w, MASK_WORD_BITS) * weights).sum(-1)  # in [0, 2**32)
    words = torch.where(words >= 2**31, words - 2**32, words)  # two's-complement int32 view
    return words.to(torch.int32).reshape(-1)


def build_tree_mask_buffers(
    ancestor_masks: Sequence[torch.Tensor | None],
    query_lens: Sequence[int] | torch.Tensor,
    *,
    out: TreeMaskBuffers | None = None,
    device: torch.device | str | None = None,
    validate: bool = True,
) -> TreeMaskBuffers:
    """Pack one ancestor mask per request into the kernel's bitmask layout.

    Args:
        ancestor_masks: per request, ``None`` (no tree) or a ``[m, m]`` bool mask (``m = n + 1 <=``
            :data:`MAX_TREE_ROWS`), ``[a, b]`` true iff tree row ``a`` sees tree key ``b``
            (``vllm_ddtree.tree.DraftTree.ancestor_mask``). The tree occupies the request's last
            ``m`` rows.
        query_lens: per request, its number of query rows (host ints; a tensor is read with
            ``tolist()``).
        out: preallocated buffers (:func:`allocate_tree_mask_buffers`) written in place; their
            ``tree_start`` entries past ``len(ancestor_masks)`` are set to ``-1``. Without it,
            fresh exactly-sized buffers are made on ``device`` (default: the first mask's device,
            else CPU).
        validate: also check that every mask's diagonal is set (a node sees itself); this reads
            the masks on the host (a device sync for CUDA masks).

    Returns:
        The buffers (``out`` itself when given).

    Raises:
        ValueError: lengths differ, a mask is not square bool, a tree is larger than
            :data:`MAX_TREE_ROWS` or its request's rows, an empty diagonal (``validate``), or
            ``out`` is too small.
    """
    if isinstance(query_lens, torch.Tensor):
        query_lens = query_lens.tolist()
    query_lens = [int(q) for q in query_lens]
    num_reqs = len(ancestor_masks)
    if len(query_lens) != num_reqs:
        raise ValueError(
            f"{num_reqs} ancestor masks but {len(query_lens)} query lengths"
        )
    if device is None:
        if out is not None:
            device = out.tree_mask.device
        else:
            device = next((m.device for m in ancestor_masks if m is not None), torch.device("cpu"))
    tree_start: list[int] = []
    offsets: list[int] = []
    packed: list[torch.Tensor] = []
    total = 0
    for r, (mask, q_len) in enumerate(zip(ancestor_masks, query_lens)):
        if q_len < 0:
            raise ValueError(f"request {r}: query length {q_len} < 0")
        if mask is None:
            tree_start.append(-1)
            offsets.append(0)
            continue
        if mask.dim() != 2 or mask.shape[0] != mask.shape[1] or mask.dtype != torch.bool:
            raise ValueError(
                f"request {r}: ancestor mask must be a square bool [m, m] tensor, got "
                f"{mask.dtype} {tuple(mask.shape)}"
            )
        m = mask.shape[0]
        if not 1 <= m <= MAX_TREE_ROWS:
            raise ValueError(f"request {r}: tree of {m} rows outside [1, {MAX_TREE_ROWS}]")
        if m > q_len:
            raise ValueError(f"request {r}: tree of {m} rows but the request has {q_len} rows")
        if validate and not bool(mask.diagonal().all()):
            raise ValueError(f"request {r}: ancestor mask diagonal not set (a node must see itself)")
        tree_start.append(q_len - m)
        offsets.append(total)
        packed.append(_pack_rows(mask.to(device)))
        total += tree_mask_words(m)

    if out is None:
        out = TreeMaskBuffers(
            tree_start=torch.empty(num_reqs, dtype=torch.int32, device=device),
            tree_mask=torch.zeros(max(total, 1), dtype=torch.int32, device=device),
            tree_mask_offsets=torch.empty(num_reqs, dtype=torch.int32, device=device),
        )
    else:
        if out.tree_start.numel() < num_reqs or out.tree_mask_offsets.numel() < num_reqs:
            raise ValueError(
                f"out holds {out.tree_start.numel()} requests, {num_reqs} needed"
            )
        if out.tree_mask.numel() < total:
            raise ValueError(f"out.tree_mask holds {out.tree_mask.numel()} words, {total} needed")
        for name in ("tree_start", "tree_mask", "tree_mask_offsets"):
            t = getattr(out, name)
            if t.dtype != torch.int32 or t.dim() != 1:
                raise ValueError(f"out.{name} must be 1-D int32, got {t.dtype} {tuple(t.shape)}")
    ts = torch.tensor(tree_start, dtype=torch.int32)
    offs = torch.tensor(offsets, dtype=torch.int32)
    out.tree_start[:num_reqs].copy_(ts, non_blocking=True)
    out.tree_start[num_reqs:].fill_(-1)
    out.tree_mask_offsets[:num_reqs].copy_(offs, non_blocking=True)
    if packed:
        out.tree_mask[:total].copy_(torch.cat(packed))
    return out


def unpack_tree_mask(tree_mask: torch.Tensor, offset: int, num_rows: int) -> torch.Tensor:
    """Inverse of the packing: the ``[num_rows, num_rows]`` bool mask stored at word ``offset``."""
    if num_rows < 1:
        raise ValueError(f"num_rows must be >= 1, got {num_rows}")
    w = mask_words_per_row(num_rows)
    end = offset + num_rows * w
    if offset < 0 or end > tree_mask.numel():
        raise ValueError(
            f"tree mask words [{offset}, {end}) outside the buffer of {tree_mask.numel()}"
        )
    words = tree_mask[offset:end].to(torch.int64).reshape(num_rows, w, 1)
    bits = torch.arange(MASK_WORD_BITS, dtype=torch.int64, device=tree_mask.device)
    mask = ((words >> bits) & 1).bool().reshape(num_rows, w * MASK_WORD_BITS)
    return mask[:, :num_rows].clone()


# --------------------------------------------------------------------------- torch reference


def gather_paged_kv_nhd(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table_row: torch.Tensor,
    num_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """First ``num_tokens`` keys/values of one request from an NHD paged cache.

    Token ``p`` is read at ``key_cache[block_table_row[p // block_size], p % block_size]``.

    Returns:
        ``(keys, values)``, each ``[num_tokens, num_kv_heads, head_size]`` (copies, cache dtype).

    Raises:
        ValueError: ``block_table_row`` holds fewer than ``ceil(num_tokens / block_size)`` blocks.
    """
    block_size = key_cache.shape[1]
    pos = torch.arange(num_tokens, device=key_cache.device)
    needed = -(-num_tokens // block_size)
    if block_table_row.numel() < needed:
        raise ValueError(
            f"{num_tokens} tokens need {needed} blocks, block table row has "
            f"{block_table_row.numel()}"
        )
    blocks = block_table_row.to(device=key_cache.device, dtype=torch.long)[pos // block_size]
    offs = pos % block_size
    return key_cache[blocks, offs], value_cache[blocks, offs]


def _check_metadata_host(
    num_tokens: int,
    num_blocks_per_req: int,
    block_size: int,
    seq_lens: list[int],
    qsl: list[int],
    tree_start: list[int],
    offsets: list[int],
    mask_words: int,
) -> None:
    num_reqs = len(seq_lens)
    if len(qsl) != num_reqs + 1 or len(tree_start) < num_reqs or len(offsets) < num_reqs:
        raise ValueError(
            f"query_start_loc has {len(qsl)} entries, tree_start {len(tree_start)}, "
            f"tree_mask_offsets {len(offsets)}, for {num_reqs} requests"
        )
    if qsl[0] < 0 or qsl[-1] > num_tokens:
        raise ValueError(f"query_start_loc {qsl} outside the {num_tokens} query rows")
    for r in range(num_reqs):
        q_len = qsl[r + 1] - qsl[r]
        if q_len < 0:
            raise ValueError(f"query_start_loc decreases at request {r}: {qsl}")
        if q_len == 0:
            continue
        if seq_lens[r] < q_len:
            raise ValueError(f"request {r}: seq_len {seq_lens[r]} < query length {q_len}")
        if seq_lens[r] > num_blocks_per_req * block_size:
            raise ValueError(
                f"request {r}: seq_len {seq_lens[r]} exceeds the block table "
                f"({num_blocks_per_req} blocks of {block_size})"
            )
        ts = tree_start[r]
        if ts == -1:
            continue
        if not 0 <= ts < q_len:
            raise ValueError(f"request {r}: tree_start {ts} outside [0, {q_len}) (or -1)")
        need = tree_mask_words(q_len - ts)
        if offsets[r] < 0 or offsets[r] + need > mask_words:
            raise ValueError(
                f"request {r}: tree mask words [{offsets[r]}, {offsets[r] + need}) outside the "
                f"buffer of {mask_words}"
            )


def _causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int, scale: float
) -> torch.Tensor:
    """``q`` ``[L, H, D]`` at positions ``first_pos ..``, causal over ``k``/``v`` ``[S, Hkv, D]``;
    float32 SDPA with an explicit bool mask. Returns ``[L, H, D]`` float32."""
    num_rows, num_heads, _ = q.shape
    seq = k.shape[0]
    group = num_heads // k.shape[1]
    qpos = first_pos + torch.arange(num_rows, device=q.device)
    visible = torch.arange(seq, device=q.device)[None, :] <= qpos[:, None]  # [L, S]
    qf = q.float().transpose(0, 1)  # [H, L, D]
    kf = k.float().transpose(0, 1).repeat_interleave(group, dim=0)
    vf = v.float().transpose(0, 1).repeat_interleave(group, dim=0)
    out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=visible, scale=float(scale))
    return out.transpose(0, 1)


def tree_attention_paged_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    tree_start: torch.Tensor,
    tree_mask: torch.Tensor,
    tree_mask_offsets: torch.Tensor,
    scale: float,
    output: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch oracle for :func:`tree_attention_paged` (same arguments and semantics).

    Per request: gather its keys/values from the NHD cache (:func:`gather_paged_kv_nhd`); ordinary
    rows get causal float32 SDPA; tree rows get
    :func:`vllm_ddtree.attention.paged.tree_attention_reference` over the whole sequence with the
    unpacked mask. Slow (host loop, syncs); for tests and debugging.

    Returns:
        ``output`` (or a new zero tensor like ``query``) with the requests' rows written; rows
        past ``query_start_loc[-1]`` are left as they were.

    Raises:
        ValueError: the same shape/dtype errors as the kernel, plus every metadata check
            (``check_metadata=True`` of the kernel).
    """
    _check_args(query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
                tree_start, tree_mask, tree_mask_offsets, output)
    block_size = key_cache.shape[1]
    seq_l = seq_lens.tolist()
    qsl = query_start_loc.tolist()
    ts_l = tree_start.tolist()
    off_l = tree_mask_offsets.tolist()
    _check_metadata_host(query.shape[0], block_table.shape[1], block_size, seq_l, qsl, ts_l,
                         off_l, tree_mask.numel())
    if output is None:
        output = torch.zeros_like(query)
    for r in range(len(seq_l)):
        q_lo, q_hi = qsl[r], qsl[r + 1]
        q_len = q_hi - q_lo
        if q_len == 0:
            continue
        seq = seq_l[r]
        keys, values = gather_paged_kv_nhd(key_cache, value_cache, block_table[r], seq)
        first_pos = seq - q_len
        ts = ts_l[r]
        n_plain = q_len if ts == -1 else ts
        if n_plain:
            out = _causal_attention(query[q_lo:q_lo + n_plain], keys, values, first_pos, scale)
            output[q_lo:q_lo + n_plain] = out.to(output.dtype)
        if ts != -1:
            m = q_len - ts
            mask = unpack_tree_mask(tree_mask, off_l[r], m)
            out = tree_attention_reference(
                query[q_lo + ts:q_hi], keys, values, first_pos + ts, mask, scale
            )
            output[q_lo + ts:q_hi] = out.to(output.dtype)
    return output


# --------------------------------------------------------------------------- Triton kernel

if HAS_TRITON:

    @triton.jit
    def _dot(a, b, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
        """``a @ b`` with float32 accumulation. ``DOT_UPCAST`` multiplies in float32 (exact for
        16-bit inputs): Triton 3.9's interpreter computes bf16 ``tl.dot`` on raw bits."""
        if DOT_UPCAST:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        return tl.dot(a, b, input_precision=DOT_PRECISION)

    @triton.jit
    def _tree_attention_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr,
        block_table_ptr, seq_lens_ptr, qsl_ptr,
        tree_start_ptr, mask_ptr, mask_off_ptr,
        scale_log2,
        stride_qt, stride_qh, stride_qd,
        stride_kb, stride_ko, stride_kh, stride_kd,
        stride_vb, stride_vo, stride_vh, stride_vd,
        stride_ot, stride_oh, stride_od,
        stride_bt,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        HEAD_SIZE: tl.constexpr,
        HEAD_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        TILE_N: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        DOT_UPCAST: tl.constexpr,
    ):
        # One program: BLOCK_Q consecutive query rows of one request x the GROUP query heads of
        # one KV head = BLOCK_M = BLOCK_Q * GROUP_PAD softmax rows.
        req = tl.program_id(0)
        q_blk = tl.program_id(1)
        kv_head = tl.program_id(2)
        BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD

        q_begin = tl.load(qsl_ptr + req)
        q_len = tl.load(qsl_ptr + req + 1) - q_begin
        if q_blk * BLOCK_Q >= q_len:
            return
        seq_len = tl.load(seq_lens_ptr + req)
        first_pos = seq_len - q_len
        ts = tl.load(tree_start_ptr + req)
        # -1 (no tree) -> a first tree row no row reaches (no scalar-bool & tensor-bool: the
        # interpreter mistypes that broadcast).
        ts_eff = tl.where(ts >= 0, ts, 2147483647)
        root_pos = first_pos + ts
        words = (q_len - ts + 31) // 32
        mask_base = tl.load(mask_off_ptr + req).to(tl.int64)

        m_idx = tl.arange(0, BLOCK_M)
        qi = q_blk * BLOCK_Q + m_idx // GROUP_PAD  # row within the request
        g = m_idx % GROUP_PAD
        head = kv_head * GROUP + g
        row_ok = (qi < q_len) & (g < GROUP)
        qpos = first_pos + qi
        is_tree = qi >= ts_eff
        d = tl.arange(0, HEAD_PAD)
        d_ok = d < HEAD_SIZE

        q_rows = (q_begin + qi).to(tl.int64)
        q = tl.load(
            q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh
            + d[None, :] * stride_qd,
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )

        # Keys below `full_end` are visible to every live row of this program (no masking);
        # keys at or past `kv_end` to none.
        full_row = tl.where(is_tree, root_pos, qpos + 1)
        end_row = tl.where(is_tree, seq_len, qpos + 1)
        full_end = tl.min(tl.where(row_ok, full_row, 2147483647), axis=0)
        kv_end = tl.max(tl.where(row_ok, end_row, 0), axis=0)
        num_full = full_end // TILE_N

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
        n_off = tl.arange(0, TILE_N)
        bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
        k_head = k_ptr + kv_head * stride_kh
        v_head = v_ptr + kv_head * stride_vh

        # Phase 1: fully visible key tiles.
        for tile in range(0, num_full):
            kpos = tile * TILE_N + n_off
            blk = tl.load(bt_row + kpos // BLOCK_SIZE).to(tl.int64)
            off = (kpos % BLOCK_SIZE).to(tl.int64)
            k = tl.load(
                k_head + blk[None, :] * stride_kb + off[None, :] * stride_ko
                + d[:, None] * stride_kd,
                mask=d_ok[:, None],
                other=0.0,
            )  # [HEAD_PAD, TILE_N]
            v = tl.load(
                v_head + blk[:, None] * stride_vb + off[:, None] * stride_vo
                + d[None, :] * stride_vd,
                mask=d_ok[None, :],
                other=0.0,
            )  # [TILE_N, HEAD_PAD]
            s = _dot(q, k, DOT_PRECISION, DOT_UPCAST) * scale_log2
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
            m_i = m_new

        # Phase 2: the remaining tiles, masked per (row, key).
        for start in range(num_full * TILE_N, kv_end, TILE_N):
            kpos = start + n_off
            k_ok = kpos < seq_len
            blk = tl.load(bt_row + kpos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
            off = (kpos % BLOCK_SIZE).to(tl.int64)
            k = tl.load(
                k_head + blk[None, :] * stride_kb + off[None, :] * stride_ko
                + d[:, None] * stride_kd,
                mask=d_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            v = tl.load(
                v_head + blk[:, None] * stride_vb + off[:, None] * stride_vo
                + d[None, :] * stride_vd,
                mask=d_ok[None, :] & k_ok[:, None],
                other=0.0,
            )
            rel = kpos - root_pos  # key index within the tree (tree rows only)
            in_tree = rel >= 0
            rel_c = tl.maximum(rel, 0)
            word = tl.load(
                mask_ptr + mask_base + ((qi - ts) * words)[:, None] + (rel_c // 32)[None, :],
                mask=(row_ok & is_tree)[:, None] & (in_tree & k_ok)[None, :],
                other=0,
            )
            bit = (word >> (rel_c % 32)[None, :]) & 1
            tree_vis = (~in_tree)[None, :] | (bit != 0)
            causal_vis = kpos[None, :] <= qpos[:, None]
            visible = tl.where(is_tree[:, None], tree_vis, causal_vis)
            visible = visible & k_ok[None, :] & row_ok[:, None]

            s = _dot(q, k, DOT_PRECISION, DOT_UPCAST) * scale_log2
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
            m_i = m_new

        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        tl.store(
            o_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh
            + d[None, :] * stride_od,
            out.to(o_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


# --------------------------------------------------------------------------- launch parameters

#: Shared memory one thread block may use (bytes, the opt-in maximum) per CUDA compute
#: capability, from the CUDA C++ Programming Guide's table "Technical Specifications per Compute
#: Capability". :func:`device_shared_memory_limit` reads the device's own figure and falls back
#: to this table.
SHARED_MEMORY_PER_BLOCK = {
    80: 166_912,   # A100
    86: 101_376,   # RTX 3090, A6000, A10
    87: 166_912,   # Jetson Orin
    89: 101_376,   # RTX 4090, L40S, L4
    90: 232_448,   # H100, H200
    100: 232_448,  # B200
    103: 232_448,  # B300
    120: 101_376,  # RTX 5090, RTX PRO 6000
    121: 101_376,  # DGX Spark
}


class TreeKernelResourceError(ValueError):
    """No launch configuration of the tree-attention kernel fits the device's shared memory."""


@dataclass(frozen=True)
class TreeKernelConfig:
    """Launch parameters of :func:`_tree_attention_kernel` for one shape on one device.

    Attributes:
        block_m: softmax rows per program (query rows x padded GQA group), power of two >= 16.
        tile_n: keys per inner iteration, power of two >= 16.
        num_warps, num_stages: Triton launch options.
        shared_bytes: upper bound on the shared memory one program needs
            (:func:`estimate_shared_bytes`), in bytes.
    """

    block_m: int
    tile_n: int
    num_warps: int
    num_stages: int
    shared_bytes: int


def estimate_shared_bytes(block_m: int, tile_n: int, head_size: int, element_size: int) -> int:
    """Upper bound on the shared memory (bytes) of one program of the tree-attention kernel.

    The terms are the kernel's tiles: a K and a V tile (``tile_n x head_pad`` each), the Q tile
    (``block_m x head_pad``), the fp32 scores and the probabilities in the input dtype
    (``block_m x tile_n`` each). Triton stages each of these through shared memory for the
    ``tl.dot`` operand layouts; on sm_90 with ``block_m >= 64`` (warp-group MMA) the Q and score
    tiles take a second buffer, so those two terms are counted twice. The ahead-of-time compile
    test (``tests/test_triton_aot.py``) checks the bound against Triton's own ``metadata.shared``
    for every configuration :func:`choose_tree_kernel_config` picks on sm_80 ... sm_120.

    Args:
        block_m, tile_n: as in :class:`TreeKernelConfig`.
        head_size: the head size (padded inside to a power of two >= 16).
        element_size: bytes per element of the query / KV cache (2 or 4).
    """
    head_pad = max(16, _next_pow2(head_size))
    kv = 2 * tile_n * head_pad * element_size
    q = block_m * head_pad * element_size
    scores = block_m * tile_n * (4 + element_size)
    return kv + 2 * q + 2 * scores


@functools.lru_cache(maxsize=4096)  # pure, and called for every layer of every step
def choose_tree_kernel_config(
    dtype: torch.dtype,
    head_size: int,
    group: int,
    max_query_len: int,
    shared_limit: int | None = None,
) -> TreeKernelConfig:
    """Launch parameters for the tree-attention kernel, within the device's shared memory.

    Starts from the configuration preferred for the shape and halves ``tile_n``, then
    ``block_m``, until :func:`estimate_shared_bytes` fits ``shared_limit``. Preferred (chosen
    from ahead-of-time compiles for sm_80 ... sm_120 for no or few register spills, see
    ``docs/cuda_kernel_resources.md``):

    * ``block_m``: the step's rows x padded GQA group, rounded up to a power of two, between 16
      and 64 for 16-bit heads up to 128 wide, 32 for wider 16-bit heads and 16 for float32
      (vLLM's ``unified_attention`` runs 16 softmax rows per program; a draft tree of many rows
      reads each K/V tile once for up to 64 of them);
    * ``tile_n``: 64 keys for 16-bit heads up to 128 wide, 32 for wider ones, 16 for float32
      (IEEE fp32 products run on the FMA units and hold their operands in registers);
    * ``num_warps``: 8 for 16-bit inputs from ``block_m x tile_n >= 2048`` or
      ``block_m x head_pad >= 8192``, else 4; ``num_stages`` 2 (the K/V loads gather through
      the block table, so deeper pipelining only adds buffers).

    Args:
        dtype: query / KV-cache dtype (fp16, bf16, fp32).
        head_size: head size (any; padded inside to a power of two >= 16).
        group: query heads per KV head (GQA group), >= 1.
        max_query_len: the most rows any request has in the launch, >= 1.
        shared_limit: the device's shared memory per block in bytes
            (:func:`device_shared_memory_limit`); ``None``: Triton's interpreter on CPU tensors,
            which has no GPU resources and runs fastest with the largest tiles (``block_m`` up to
            128, 64-key tiles).

    Returns:
        The :class:`TreeKernelConfig`.

    Raises:
        TreeKernelResourceError: even ``block_m = max(16, padded group)`` with 16-key tiles does
            not fit ``shared_limit``.
        ValueError: an unsupported dtype or a non-positive size.
    """
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {dtype} not in {SUPPORTED_DTYPES}")
    if head_size < 1 or group < 1 or max_query_len < 1:
        raise ValueError(
            f"head_size, group and max_query_len must be >= 1, got {head_size}, {group}, "
            f"{max_query_len}"
        )
    element_size = dtype.itemsize
    head_pad = max(16, _next_pow2(head_size))
    group_pad = _next_pow2(group)
    if element_size == 4:
        max_block_m, tile_n = 16, 16
    elif head_pad <= 128:
        max_block_m, tile_n = 64, 64
    else:
        max_block_m, tile_n = 32, 32
    if shared_limit is None:
        # Triton's interpreter: no GPU resources, and each program and key tile is one round of
        # numpy calls, so the fewest, largest tiles run fastest.
        max_block_m, tile_n = 128, 64
    block_m = max(group_pad, min(max_block_m, max(16, _next_pow2(max_query_len * group_pad))))
    smallest_block_m = max(16, group_pad)
    while True:
        need = estimate_shared_bytes(block_m, tile_n, head_size, element_size)
        if shared_limit is None or need <= shared_limit:
            break
        if tile_n > 16:
            tile_n //= 2
        elif block_m > smallest_block_m:
            block_m //= 2
        else:
            raise TreeKernelResourceError(
                f"DDTree's CUDA tree-attention kernel needs {need} bytes of shared memory per "
                f"block for head_size={head_size}, dtype={str(dtype).removeprefix('torch.')}, "
                f"GQA group {group} (its smallest tiles: {block_m} rows x 16 keys); this GPU "
                f"allows {shared_limit}. A 16-bit --dtype halves the tiles' bytes; otherwise "
                "use a GPU with more shared memory per block"
            )
    wide = block_m * tile_n >= 2048 or block_m * head_pad >= 8192
    num_warps = 8 if element_size < 4 and wide else 4
    return TreeKernelConfig(block_m=block_m, tile_n=tile_n, num_warps=num_warps, num_stages=2,
                            shared_bytes=need)


def device_shared_memory_limit(device: torch.device | str) -> int | None:
    """Shared memory per block (bytes, opt-in maximum) of a CUDA device; ``None`` off CUDA.

    Reads ``torch.cuda.get_device_properties(device).shared_memory_per_block_optin`` (as vLLM's
    FlexAttention backend does), else the :data:`SHARED_MEMORY_PER_BLOCK` entry of the device's
    compute capability.

    Raises:
        TreeKernelResourceError: a CUDA device that reports no limit and whose capability is not
            in :data:`SHARED_MEMORY_PER_BLOCK`.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_shared_memory_limit(index)


@functools.lru_cache(maxsize=None)
def _cuda_shared_memory_limit(index: int) -> int:
    props = torch.cuda.get_device_properties(index)
    limit = getattr(props, "shared_memory_per_block_optin", None)
    if limit:
        return int(limit)
    cap = props.major * 10 + props.minor
    if cap not in SHARED_MEMORY_PER_BLOCK:
        raise TreeKernelResourceError(
            f"DDTree's CUDA tree-attention kernel: {props.name} (sm_{cap}) reports no shared "
            f"memory limit and is not one of the known architectures "
            f"{sorted(SHARED_MEMORY_PER_BLOCK)}"
        )
    return SHARED_MEMORY_PER_BLOCK[cap]


def check_tree_kernel_fits(
    dtype: torch.dtype, head_size: int, group: int, device: torch.device | str
) -> TreeKernelConfig | None:
    """Engine start-up check: the tree kernel has a launch configuration on ``device`` for every
    row count a step can have (trees of 1 .. :data:`MAX_TREE_ROWS` rows, longer prefill chunks).

    Returns:
        The configuration of a :data:`MAX_TREE_ROWS`-row launch, or ``None`` off CUDA (no limit
        to check).

    Raises:
        TreeKernelResourceError: see :func:`choose_tree_kernel_config`.
    """
    limit = device_shared_memory_limit(device)
    if limit is None:
        return None
    # The choice steps down to the same smallest tiles from any row count, so one count that
    # starts from the largest tiles decides for all.
    return choose_tree_kernel_config(dtype, head_size, group, MAX_TREE_ROWS, limit)


def _check_args(query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
                tree_start, tree_mask, tree_mask_offsets, output) -> None:
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_heads, head_size], got {tuple(query.shape)}")
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape:
        raise ValueError(
            f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} must "
            "both be [num_blocks, block_size, num_kv_heads, head_size]"
        )
    _, num_heads, head_size = query.shape
    _, _, num_kv_heads, kv_head_size = key_cache.shape
    if kv_head_size != head_size:
        raise ValueError(f"query head_size {head_size} != cache head_size {kv_head_size}")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if query.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"query dtype {query.dtype} not in {SUPPORTED_DTYPES}")
    if key_cache.dtype != query.dtype or value_cache.dtype != query.dtype:
        raise ValueError(
            f"cache dtype {key_cache.dtype}/{value_cache.dtype} must equal the query dtype "
            f"{query.dtype} (quantised/fp8 caches are not supported)"
        )
    if output is not None:
        if output.shape != query.shape or output.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"output must be a float tensor shaped like query {tuple(query.shape)}, got "
                f"{output.dtype} {tuple(output.shape)}"
            )
    num_reqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    meta = {
        "block_table": (block_table, 2),
        "seq_lens": (seq_lens, 1),
        "query_start_loc": (query_start_loc, 1),
        "tree_start": (tree_start, 1),
        "tree_mask": (tree_mask, 1),
        "tree_mask_offsets": (tree_mask_offsets, 1),
    }
    for name, (t, ndim) in meta.items():
        if t.dtype != torch.int32 or t.dim() != ndim:
            raise ValueError(f"{name} must be a {ndim}-D int32 tensor, got {t.dtype} {tuple(t.shape)}")
    if (
        block_table.shape[0] < num_reqs
        or query_start_loc.shape[0] != num_reqs + 1
        or tree_start.shape[0] < num_reqs
        or tree_mask_offsets.shape[0] < num_reqs
    ):
        raise ValueError(
            f"{num_reqs} requests (seq_lens) but block_table {tuple(block_table.shape)}, "
            f"query_start_loc {tuple(query_start_loc.shape)} (needs num_reqs + 1), tree_start "
            f"{tuple(tree_start.shape)}, tree_mask_offsets {tuple(tree_mask_offsets.shape)}"
        )
    tensors = [query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
               tree_start, tree_mask, tree_mask_offsets] + ([output] if output is not None else [])
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def tree_attention_paged(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    tree_start: torch.Tensor,
    tree_mask: torch.Tensor,
    tree_mask_offsets: torch.Tensor,
    scale: float,
    output: torch.Tensor | None = None,
    *,
    max_query_len: int | None = None,
    block_m: int | None = None,
    tile_n: int | None = None,
    allow_tf32: bool = False,
    num_warps: int | None = None,
    num_stages: int | None = None,
    check_metadata: bool = False,
) -> torch.Tensor:
    """Causal + per-request tree attention over an NHD paged KV cache (Triton).

    Args:
        query: ``[num_tokens, num_heads, head_size]`` fp32/fp16/bf16 (last dim may be strided).
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``, the query's
            dtype (any strides); ``num_heads % num_kv_heads == 0``; any head size (padded to a
            power of two >= 16 inside) and block size.
        block_table: ``[>= num_reqs, max_blocks]`` int32 block ids.
        seq_lens: ``[num_reqs]`` int32 total tokens per request (context + this step's rows).
        query_start_loc: ``[num_reqs + 1]`` int32 cumulative row offsets into ``query``.
        tree_start, tree_mask, tree_mask_offsets: the tree masks (:class:`TreeMaskBuffers`,
            layout in the module docstring; int32). ``tree_start[r] == -1``: causal only.
        scale: softmax scale.
        output: ``[num_tokens, num_heads, head_size]`` float tensor written in place (default: a
            new tensor like ``query``). Rows outside ``query_start_loc[0] .. [-1]`` are untouched.
        max_query_len: upper bound on any request's rows; sizes the launch grid. Pass it (a host
            int, fixed across steps) to avoid a device sync and to keep a CUDA graph's grid static.
        block_m: softmax rows per program (power of two >= 16). Rounded up to at least the
            padded GQA group.
        tile_n: keys per inner iteration (power of two >= 16).
        allow_tf32: use TF32 products for fp32 inputs (faster, less exact).
        num_warps, num_stages: Triton launch options.
            Each of ``block_m``, ``tile_n``, ``num_warps``, ``num_stages`` left ``None`` comes
            from :func:`choose_tree_kernel_config` for this shape and the device's shared memory
            (what the engine runs).
        check_metadata: validate ``seq_lens``/``query_start_loc``/``tree_start``/offsets on the
            host first (device sync). Without it, inconsistent metadata gives undefined results.

    Returns:
        ``output``.

    Raises:
        ValueError: bad shapes, dtypes (int32 metadata, float data, cache dtype == query dtype),
            devices, GQA ratio, or (``check_metadata``) inconsistent metadata.
        TreeKernelResourceError: no configuration fits the device's shared memory.
        RuntimeError: Triton is not installed.
    """
    _check_args(query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
                tree_start, tree_mask, tree_mask_offsets, output)
    if output is None:
        output = torch.empty_like(query)
    num_reqs = seq_lens.shape[0]
    _, block_size, num_kv_heads, head_size = key_cache.shape
    num_heads = query.shape[1]
    if check_metadata:
        _check_metadata_host(query.shape[0], block_table.shape[1], block_size, seq_lens.tolist(),
                             query_start_loc.tolist(), tree_start.tolist(),
                             tree_mask_offsets.tolist(), tree_mask.numel())
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if num_reqs else 0
    if num_reqs == 0 or max_query_len <= 0 or query.shape[0] == 0:
        return output

    group = num_heads // num_kv_heads
    group_pad = _next_pow2(group)
    for name, val in (("block_m", block_m), ("tile_n", tile_n)):
        if val is not None and (val < 16 or val & (val - 1)):
            raise ValueError(f"{name} must be a power of two >= 16, got {val}")
    chosen = choose_tree_kernel_config(query.dtype, head_size, group, max_query_len,
                                       device_shared_memory_limit(query.device))
    block_m = max(chosen.block_m if block_m is None else block_m, group_pad)
    tile_n = chosen.tile_n if tile_n is None else tile_n
    num_warps = chosen.num_warps if num_warps is None else num_warps
    num_stages = chosen.num_stages if num_stages is None else num_stages
    block_q = block_m // group_pad
    head_pad = max(16, _next_pow2(head_size))
    precision = "tf32" if (allow_tf32 and query.dtype == torch.float32) else "ieee"
    if not HAS_TRITON:
        raise RuntimeError("tree_attention_paged needs Triton (pip install triton)")
    grid = (num_reqs, triton.cdiv(max_query_len, block_q), num_kv_heads)
    _tree_attention_kernel[grid](
        query, key_cache, value_cache, output,
        block_table, seq_lens, query_start_loc,
        tree_start, tree_mask, tree_mask_offsets,
        float(scale) * math.log2(math.e),
        query.stride(0), query.stride(1), query.stride(2),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), key_cache.stride(3),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), value_cache.stride(3),
        output.stride(0), output.stride(1), output.stride(2),
        block_table.stride(0),
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        TILE_N=tile_n,
        DOT_PRECISION=precision,
        # Only the interpreter runs on non-CUDA tensors; its bf16 tl.dot is wrong.
        DOT_UPCAST=(query.device.type != "cuda" and query.dtype == torch.bfloat16),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return output


# --------------------------------------------------------------------------- KV compaction


def _check_slots(src_slots: torch.Tensor, dst_slots: torch.Tensor, device: torch.device) -> None:
    if src_slots.dim() != 1 or src_slots.shape != dst_slots.shape:
        raise ValueError(
            f"src_slots {tuple(src_slots.shape)} and dst_slots {tuple(dst_slots.shape)} must be "
            "1-D of equal length"
        )
    for name, t in (("src_slots", src_slots), ("dst_slots", dst_slots)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32/int64, got {t.dtype}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, the cache on {device}")


def compact_kv_nhd(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
) -> None:
    """Copy K/V of slots ``src_slots[i]`` onto ``dst_slots[i]`` in NHD caches, in place.

    After a verification step the accepted path's nodes sit at their tree slots (node ``i`` at
    position ``context_len + i``); committing moves node ``path[k]`` to position
    ``context_len + k``. All sources are gathered first (one advanced-index gather per cache) and
    then scattered (one ``index_put_``), so overlapping source/destination sets need no ordering.

    Args:
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``, any
            strides (views such as ``kv_cache[0]`` or ``kv_cache.unbind(1)[0]`` are written
            through); slot = ``block_id * block_size + offset``.
        src_slots, dst_slots: ``[k]`` int32/int64 on the cache's device; ``dst_slots`` must be
            distinct (duplicates: unspecified which source wins). Not range-checked on the host.

    Raises:
        ValueError: shape/dtype/device mismatch.
    """
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            f"key_cache {tuple(key_cache.shape)} / value_cache {tuple(value_cache.shape)} must be "
            "[num_blocks, block_size, num_kv_heads, head_size]"
        )
    _check_slots(src_slots, dst_slots, key_cache.device)
    block_size = key_cache.shape[1]
    src, dst = src_slots.long(), dst_slots.long()
    src_blk, src_off = src // block_size, src % block_size
    dst_blk, dst_off = dst // block_size, dst % block_size
    for cache in (key_cache, value_cache):
        gathered = cache[src_blk, src_off]  # [k, Hkv, D], a copy: all sources read first
        cache[dst_blk, dst_off] = gathered


def compact_kv_stacked(
    kv_cache: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor
) -> None:
    """:func:`compact_kv_nhd` for the stacked ``[2, num_blocks, block_size, num_kv_heads,
    head_size]`` cache of vLLM's FlashAttention backend (``kv_cache[0]`` keys, ``[1]`` values):
    one gather and one scatter over both halves at once.

    Raises:
        ValueError: not 5-D with a leading 2, or a slot shape/dtype/device mismatch.
    """
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            "kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_size], got "
            f"{tuple(kv_cache.shape)}"
        )
    _check_slots(src_slots, dst_slots, kv_cache.device)
    block_size = kv_cache.shape[2]
    src, dst = src_slots.long(), dst_slots.long()
    gathered = kv_cache[:, src // block_size, src % block_size]  # [2, k, Hkv, D] copy
    kv_cache[:, dst // block_size, dst % block_size] = gathered
