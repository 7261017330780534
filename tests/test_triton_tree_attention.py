"""Triton tree attention over the NHD paged cache (``vllm_ddtree.attention.triton_tree``).

Runs the kernel under Triton's interpreter (``TRITON_INTERPRET=1``, set here before Triton is
imported) on CPU tensors, and compares it with the module's torch reference, which itself is
checked against :func:`vllm_ddtree.attention.paged.tree_attention_reference` fed the original bool
masks. Shapes are small: the interpreter runs every program in Python.

``TRITON_INTERPRET`` must stay set while interpreted kernels run, so it remains set for the rest of
the pytest process (harmless to vLLM on CPU, which disables Triton without a CPU backend). With
``TRITON_INTERPRET=0`` on a CUDA machine the same tests run the compiled kernel on the GPU.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

try:
    import triton  # noqa: F401

    _NO_KERNEL = None
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        _NO_KERNEL = "TRITON_INTERPRET is not 1 and there is no GPU"
except ImportError:
    _NO_KERNEL = "triton is not installed (the kernel tests need it: pip install triton==3.9.0)"

if _NO_KERNEL is not None and os.environ.get("CI") == "true":
    # CI installs triton (the `cpu` extra): a silent skip there would hide the kernel tests.
    raise RuntimeError(f"the Triton kernel tests cannot run in CI: {_NO_KERNEL}")

#: The mask builder, torch reference and KV compaction are pure torch and always run.
needs_kernel = pytest.mark.skipif(_NO_KERNEL is not None, reason=_NO_KERNEL or "")

from vllm_ddtree.attention.paged import tree_attention_reference  # noqa: E402
from vllm_ddtree.attention.triton_tree import (  # noqa: E402
    MAX_TREE_ROWS,
    TreeMaskBuffers,
    allocate_tree_mask_buffers,
    build_tree_mask_buffers,
    compact_kv_nhd,
    compact_kv_stacked,
    gather_paged_kv_nhd,
    max_tree_mask_words,
    tree_attention_paged,
    tree_attention_paged_reference,
    tree_mask_words,
    unpack_tree_mask,
)

DEVICE = "cuda" if _NO_KERNEL is None and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


# --------------------------------------------------------------------------- helpers


def random_parents(m: int, gen: torch.Generator) -> list[int]:
    """Parent of each node of a random ``m``-node tree in topological order (root: -1)."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, m)]


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    m = len(parents)
    mask = torch.zeros(m, m, dtype=torch.bool)
    for i in range(m):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


class Case:
    """A random batch: request ``r`` has ``q_lens[r]`` rows, ``seq_lens[r]`` tokens, and a tree of
    ``tree_rows[r]`` rows (0 = none) ending at its last row. The block table is a random
    permutation of the cache's blocks; ``query`` has two spare rows past the batch."""

    def __init__(self, q_lens, seq_lens, tree_rows, *, num_heads, num_kv_heads, head_size,
                 block_size, dtype=torch.float32, seed=0, chain=False):
        gen = torch.Generator().manual_seed(seed)
        self.q_lens, self.seq_lens_l, self.tree_rows = list(q_lens), list(seq_lens), list(tree_rows)
        num_reqs = len(q_lens)
        max_blocks = max(1, max(-(-s // block_size) for s in seq_lens))
        num_blocks = num_reqs * max_blocks + 3
        shape = (num_blocks, block_size, num_kv_heads, head_size)
        self.key_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
        self.value_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
        perm = torch.randperm(num_blocks, generator=gen)[: num_reqs * max_blocks]
        self.block_table = perm.view(num_reqs, max_blocks).to(torch.int32).to(DEVICE)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
        qsl = [0]
        for q in q_lens:
            qsl.append(qsl[-1] + q)
        self.query_start_loc = torch.tensor(qsl, dtype=torch.int32, device=DEVICE)
        self.query = torch.randn(qsl[-1] + 2, num_heads, head_size, generator=gen).to(dtype)
        self.query = self.query.to(DEVICE)
        self.masks = []
        for m in tree_rows:
            if not m:
                self.masks.append(None)
            elif chain:
                self.masks.append(torch.ones(m, m, dtype=torch.bool).tril())
            else:
                self.masks.append(ancestor_mask(random_parents(m, gen)))
        self.buffers = build_tree_mask_buffers(self.masks, q_lens, device=DEVICE)
        self.scale = head_size**-0.5

    def meta(self, buffers: TreeMaskBuffers | None = None):
        b = buffers or self.buffers
        return (self.block_table, self.seq_lens, self.query_start_loc, b.tree_start, b.tree_mask,
                b.tree_mask_offsets, self.scale)

    def kernel(self, buffers=None, query=None, key_cache=None, value_cache=None, **kw):
        q = self.query if query is None else query
        out = torch.full_like(q, 7.0)  # rows outside the batch must stay 7
        return tree_attention_paged(
            q, self.key_cache if key_cache is None else key_cache,
            self.value_cache if value_cache is None else value_cache, *self.meta(buffers),
            output=out, check_metadata=True, **kw,
        )

    def reference(self, buffers=None):
        out = torch.full_like(self.query, 7.0)
        return tree_attention_paged_reference(
            self.query, self.key_cache, self.value_cache, *self.meta(buffers), output=out
        )


# A batch mixing every kind of request: a prefill chunk, plain decode rows, trees of 1, 5, 12
# and 33 rows (33: two mask words per row), a tree after a prefill chunk in the same request,
# a tree at context 0, and an empty (padding) request.
MIXED = dict(
    q_lens=[20, 1, 5, 1, 12, 33, 9, 0, 6],
    seq_lens=[20, 37, 50, 5, 12, 70, 30, 0, 41],
    tree_rows=[0, 0, 5, 1, 12, 33, 6, 0, 0],
)


def assert_close(got, want, tol):
    diff = (got.float() - want.float()).abs().max().item()
    assert diff <= tol, f"max abs diff {diff} > {tol}"


# --------------------------------------------------------------------------- kernel vs reference


@needs_kernel
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_size,block_size,dtype,tol",
    [
        (4, 2, 32, 16, torch.float32, 2e-5),
        (4, 1, 64, 32, torch.float32, 2e-5),
        (6, 2, 64, 16, torch.float32, 2e-5),  # GQA group 3 (padded to 4)
        (2, 2, 128, 32, torch.float32, 2e-5),
        (4, 2, 64, 16, torch.bfloat16, 4e-2),
        (4, 2, 32, 32, torch.float16, 5e-3),
    ],
)
def test_kernel_matches_reference_on_mixed_batch(num_heads, num_kv_heads, head_size, block_size,
                                                 dtype, tol):
    case = Case(**MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                block_size=block_size, dtype=dtype, seed=head_size + block_size)
    got = case.kernel()
    want = case.reference()
    T = int(case.query_start_loc[-1])
    assert_close(got[:T], want[:T], tol)
    assert bool((got[T:] == 7).all()), "rows past the batch were written"
    assert got.dtype == dtype and not bool(got[:T].isnan().any())


def test_reference_tree_rows_match_paged_reference_with_original_masks():
    """The module reference (which unpacks the bitmask) agrees with ``tree_attention_reference``
    given the original bool masks, so a packing bug cannot hide in both kernel and oracle."""
    case = Case(**MIXED, num_heads=4, num_kv_heads=2, head_size=32, block_size=16)
    want = case.reference()
    qsl = case.query_start_loc.tolist()
    for r, mask in enumerate(case.masks):
        if mask is None:
            continue
        m, seq = mask.shape[0], case.seq_lens_l[r]
        keys, values = gather_paged_kv_nhd(case.key_cache, case.value_cache, case.block_table[r],
                                           seq)
        rows = slice(qsl[r + 1] - m, qsl[r + 1])
        direct = tree_attention_reference(case.query[rows], keys, values, seq - m, mask,
                                          case.scale)
        assert torch.equal(direct, want[rows])


@needs_kernel
def test_tiles_and_block_sizes_do_not_change_the_result():
    case = Case(**MIXED, num_heads=4, num_kv_heads=2, head_size=32, block_size=16, seed=3)
    want = case.reference()
    T = int(case.query_start_loc[-1])
    for block_m, tile_n in [(16, 16), (64, 32), (128, 64)]:
        got = case.kernel(block_m=block_m, tile_n=tile_n, max_query_len=40)
        assert_close(got[:T], want[:T], 2e-5)


@needs_kernel
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 4e-2)])
def test_every_configuration_chosen_for_a_gpu_gives_the_reference(dtype, tol):
    """The launch parameters the engine picks on each GPU architecture (ahead-of-time checked
    for resources in ``test_triton_aot.py``) compute the same attention."""
    from vllm_ddtree.attention.triton_tree import SHARED_MEMORY_PER_BLOCK, choose_tree_kernel_config

    case = Case(**MIXED, num_heads=8, num_kv_heads=2, head_size=64, block_size=16, dtype=dtype,
                seed=11)
    want = case.reference()
    T = int(case.query_start_loc[-1])
    configs = {choose_tree_kernel_config(dtype, 64, 4, rows, limit)
               for limit in set(SHARED_MEMORY_PER_BLOCK.values()) for rows in (1, 5, 33)}
    assert len({(c.block_m, c.tile_n) for c in configs}) >= (3 if dtype == torch.bfloat16 else 1)
    for c in configs:
        got = case.kernel(block_m=c.block_m, tile_n=c.tile_n, num_warps=c.num_warps,
                          num_stages=c.num_stages, max_query_len=40)
        assert_close(got[:T], want[:T], tol)


@needs_kernel
def test_strided_query_and_stacked_cache_layouts():
    case = Case(**MIXED, num_heads=4, num_kv_heads=2, head_size=32, block_size=16, seed=5)
    want = case.reference()
    T = int(case.query_start_loc[-1])
    # FlashAttention's stacked [2, nb, bs, Hkv, D] cache, and Triton's [nb, 2, bs, Hkv, D].
    fa = torch.stack([case.key_cache, case.value_cache])
    tr = torch.stack([case.key_cache, case.value_cache], dim=1)
    # A query whose heads are a strided slice of a wider buffer.
    wide = torch.zeros(case.query.shape[0], case.query.shape[1], 2 * case.query.shape[2],
                       device=DEVICE)
    wide[..., ::2] = case.query
    for query, k, v in [
        (case.query, fa[0], fa[1]),
        (case.query, *tr.unbind(1)),
        (wide[..., ::2], None, None),
    ]:
        got = case.kernel(query=query, key_cache=k, value_cache=v)
        assert_close(got[:T], want[:T], 2e-5)


@needs_kernel
def test_chain_tree_is_exactly_causal():
    """A tree that is a chain (every node sees all earlier nodes) is plain causal attention."""
    kw = dict(q_lens=[16, 1, 9], seq_lens=[40, 21, 9], num_heads=4, num_kv_heads=2, head_size=64,
              block_size=16, seed=11)
    chain = Case(**kw, tree_rows=[16, 0, 9], chain=True)
    causal = Case(**kw, tree_rows=[0, 0, 0])
    assert torch.equal(chain.query, causal.query)
    got = chain.kernel()
    want = causal.reference()
    T = int(chain.query_start_loc[-1])
    assert_close(got[:T], want[:T], 1e-5)
    assert_close(got[:T], causal.kernel()[:T], 1e-5)


@needs_kernel
def test_masking_one_ancestor_changes_exactly_the_rows_that_saw_it():
    case = Case(q_lens=[12], seq_lens=[45], tree_rows=[12], num_heads=2, num_kv_heads=1,
                head_size=32, block_size=16, seed=2)
    mask = case.masks[0]
    # The node with the most descendants (other than the root).
    node = max(range(1, 12), key=lambda j: int(mask[:, j].sum()))
    sees = mask[:, node].clone()
    sees[node] = False  # rows that see `node` as a strict ancestor
    assert int(sees.sum()) >= 1
    cut = mask.clone()
    cut[sees, node] = False
    buffers = build_tree_mask_buffers([cut], case.q_lens, device=DEVICE)
    before = case.kernel()
    after = case.kernel(buffers)
    assert_close(after[:12], case.reference(buffers)[:12], 2e-5)
    changed = (after[:12] != before[:12]).flatten(1).any(dim=1)
    assert torch.equal(changed, sees), (changed, sees)


@needs_kernel
def test_mask_bits_past_the_diagonal_are_honoured():
    """The kernel applies the bitmask as given, also to later tree keys (not only topological
    orders): row 1 additionally sees tree keys 3 and 7, row 0 key 9."""
    case = Case(q_lens=[10, 1], seq_lens=[40, 12], tree_rows=[10, 0], num_heads=2,
                num_kv_heads=1, head_size=32, block_size=16, seed=6)
    mask = case.masks[0].clone()
    mask[1, 3] = mask[1, 7] = mask[0, 9] = True
    buffers = build_tree_mask_buffers([mask, None], case.q_lens, device=DEVICE)
    got, want = case.kernel(buffers), case.reference(buffers)
    assert_close(got[:11], want[:11], 2e-5)
    assert (got[:2] - case.kernel()[:2]).abs().flatten(1).amax(1).min() > 1e-4


@needs_kernel
def test_benchmark_smoke_runs():
    """``benchmarks/gpu_tree_attention.py --smoke`` (the GPU script's CPU mode) is not broken."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_tree_attention.py"
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(script), "--smoke"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all checks passed" in proc.stdout and "| tree / chain |" in proc.stdout


@needs_kernel
def test_max_query_len_bound_and_empty_batch():
    case = Case(**MIXED, num_heads=4, num_kv_heads=2, head_size=32, block_size=16, seed=9)
    T = int(case.query_start_loc[-1])
    assert_close(case.kernel(max_query_len=64)[:T], case.reference()[:T], 2e-5)
    empty = Case(q_lens=[0, 0], seq_lens=[0, 3], tree_rows=[0, 0], num_heads=4, num_kv_heads=2,
                 head_size=32, block_size=16)
    assert bool((empty.kernel() == 7).all())


# --------------------------------------------------------------------------- mask buffers


def test_mask_builder_round_trips_and_writes_in_place():
    gen = torch.Generator().manual_seed(0)
    sizes = [1, 2, 31, 32, 33, 64, 65, 0, 130, MAX_TREE_ROWS]
    masks = [ancestor_mask(random_parents(m, gen)) if m else None for m in sizes]
    q_lens = [m + 3 for m in sizes]
    total = sum(sizes)
    out = allocate_tree_mask_buffers(len(sizes) + 2, total, MAX_TREE_ROWS)
    assert out.tree_mask.numel() == max_tree_mask_words(total, MAX_TREE_ROWS) >= sum(
        tree_mask_words(m) for m in sizes if m
    )
    out.tree_start.fill_(5)  # stale values from a previous step
    ptrs = [out.tree_start.data_ptr(), out.tree_mask.data_ptr(), out.tree_mask_offsets.data_ptr()]
    got = build_tree_mask_buffers(masks, q_lens, out=out)
    assert got is out
    assert ptrs == [got.tree_start.data_ptr(), got.tree_mask.data_ptr(),
                    got.tree_mask_offsets.data_ptr()]
    fresh = build_tree_mask_buffers(masks, torch.tensor(q_lens))
    offset = 0
    for r, (m, mask) in enumerate(zip(sizes, masks)):
        if mask is None:
            assert int(out.tree_start[r]) == -1
            continue
        assert int(out.tree_start[r]) == q_lens[r] - m == 3
        assert int(out.tree_mask_offsets[r]) == offset
        assert torch.equal(unpack_tree_mask(out.tree_mask, offset, m), mask)
        assert torch.equal(unpack_tree_mask(fresh.tree_mask, offset, m), mask)
        offset += tree_mask_words(m)
    assert out.tree_start[len(sizes):].tolist() == [-1, -1]
    assert fresh.tree_mask.numel() == offset


def test_mask_word_layout():
    # Row a, key b -> bit b % 32 of word a * W + b // 32 (int32 two's complement).
    mask = torch.zeros(33, 33, dtype=torch.bool)
    mask.fill_diagonal_(True)
    mask[32, 31] = True
    buf = build_tree_mask_buffers([mask], [33])
    words = buf.tree_mask.view(33, 2)
    assert words[0].tolist() == [1, 0]
    assert words[31].tolist() == [-(2**31), 0]
    assert words[32].tolist() == [-(2**31), 1]
    assert build_tree_mask_buffers([torch.ones(1, 1, dtype=torch.bool)], [1]).tree_mask.tolist() == [1]


def test_mask_builder_rejects_bad_input():
    ok = torch.eye(3, dtype=torch.bool)
    bad = [
        ([ok], [3, 1]),  # length mismatch
        ([torch.eye(3)], [3]),  # not bool
        ([torch.ones(3, 4, dtype=torch.bool)], [4]),  # not square
        ([ok], [2]),  # more tree rows than the request has
        ([ok], [-1]),
        ([torch.zeros(3, 3, dtype=torch.bool)], [3]),  # a node that does not see itself
        ([torch.eye(MAX_TREE_ROWS + 1, dtype=torch.bool)], [MAX_TREE_ROWS + 1]),
        ([torch.zeros(0, 0, dtype=torch.bool)], [1]),
    ]
    for masks, q_lens in bad:
        with pytest.raises(ValueError):
            build_tree_mask_buffers(masks, q_lens)
    small = allocate_tree_mask_buffers(1, 2)
    with pytest.raises(ValueError):  # too many words
        build_tree_mask_buffers([ok], [3], out=small)
    with pytest.raises(ValueError):  # too many requests
        build_tree_mask_buffers([None, None], [1, 1], out=small)
    with pytest.raises(ValueError):
        unpack_tree_mask(small.tree_mask, 0, 5)
    with pytest.raises(ValueError):
        max_tree_mask_words(-1)


def test_kernel_rejects_bad_input():
    case = Case(q_lens=[3, 4], seq_lens=[10, 4], tree_rows=[3, 0], num_heads=4, num_kv_heads=2,
                head_size=32, block_size=16)
    q, k, v = case.query, case.key_cache, case.value_cache
    bt, sl, qsl, ts, tm, to, scale = case.meta()

    def call(*args, **kw):
        with pytest.raises(ValueError):
            tree_attention_paged(*args, **kw)

    call(q[:, :3], k, v, bt, sl, qsl, ts, tm, to, scale)  # 3 heads vs 2 KV heads
    call(q, k.half(), v.half(), bt, sl, qsl, ts, tm, to, scale)  # cache dtype != query dtype
    call(q.to(torch.float64), k, v, bt, sl, qsl, ts, tm, to, scale)
    call(q, k[..., :16], v[..., :16], bt, sl, qsl, ts, tm, to, scale)  # head size mismatch
    call(q, k, v[:-1], bt, sl, qsl, ts, tm, to, scale)
    call(q, k, v, bt.long(), sl, qsl, ts, tm, to, scale)
    call(q, k, v, bt, sl, qsl[:-1], ts, tm, to, scale)
    call(q, k, v, bt, sl, qsl, ts[:1], tm, to, scale)
    call(q, k, v, bt, sl, qsl, ts, tm, to, scale, output=torch.empty(2, 4, 32))
    call(q, k, v, bt, sl, qsl, ts, tm.to("meta"), to, scale)  # tensors on two devices
    call(q, k, v, bt, sl, qsl, ts, tm, to, scale, block_m=24)
    call(q, k, v, bt, sl, qsl, ts, tm, to, scale, tile_n=8)
    # Metadata checks (check_metadata=True; the reference always checks).
    for bad_sl, bad_ts, bad_to in [
        (torch.tensor([2, 4]), ts, to),  # seq_len < q_len
        (torch.tensor([10, 100]), ts, to),  # past the block table
        (sl, torch.tensor([3, -1]), to),  # tree_start == q_len
        (sl, ts, torch.tensor([tm.numel() - 1, 0])),  # mask words past the buffer
    ]:
        meta = (bt, bad_sl.to(DEVICE, torch.int32), qsl, bad_ts.to(DEVICE, torch.int32), tm,
                bad_to.to(DEVICE, torch.int32), scale)
        call(q, k, v, *meta, check_metadata=True)
        with pytest.raises(ValueError):
            tree_attention_paged_reference(q, k, v, *meta)


# --------------------------------------------------------------------------- KV compaction


def _accepted_path_slots(case: Case, r: int, path: list[int]):
    """Slots of the accepted nodes ``path`` (tree indices) and of their committed positions."""
    m = case.tree_rows[r]
    root = case.seq_lens_l[r] - m
    bs = case.key_cache.shape[1]

    def slot(pos):
        return int(case.block_table[r, pos // bs]) * bs + pos % bs

    src = torch.tensor([slot(root + i) for i in path], device=DEVICE)
    dst = torch.tensor([slot(root + k) for k in range(len(path))], device=DEVICE)
    return src, dst


def test_compact_kv_both_layouts():
    case = Case(q_lens=[9], seq_lens=[30], tree_rows=[9], num_heads=2, num_kv_heads=2,
                head_size=32, block_size=16, seed=4)
    # Accepted root -> 2 -> 5 -> 7: dst slots of nodes 2 and 5 are also sources, and the
    # committed region crosses a block boundary (root at position 21, block size 16).
    src, dst = _accepted_path_slots(case, 0, [0, 2, 5, 7])
    k0, v0 = case.key_cache.clone(), case.value_cache.clone()
    flat_k, flat_v = k0.flatten(0, 1), v0.flatten(0, 1)
    want_k, want_v = flat_k.clone(), flat_v.clone()
    want_k[dst], want_v[dst] = flat_k[src], flat_v[src]
    # Skipping compaction is detectable: the cache differs from the committed one.
    assert not torch.equal(flat_k, want_k) and not torch.equal(flat_v, want_v)

    for layout in ("nhd", "stacked", "triton"):
        if layout == "nhd":
            k, v = k0.clone(), v0.clone()
            compact_kv_nhd(k, v, src, dst.to(torch.int32))
        elif layout == "stacked":
            kv = torch.stack([k0, v0])
            compact_kv_stacked(kv, src.to(torch.int32), dst)
            k, v = kv[0], kv[1]
        else:  # [nb, 2, bs, Hkv, D] halves: strided views, written through
            kv = torch.stack([k0, v0], dim=1)
            compact_kv_nhd(*kv.unbind(1), src, dst)
            k, v = kv[:, 0], kv[:, 1]
        assert torch.equal(k.flatten(0, 1), want_k), layout
        assert torch.equal(v.flatten(0, 1), want_v), layout

    # After compaction a decode row at the committed length attends to the accepted path.
    k, v = k0.clone(), v0.clone()
    compact_kv_nhd(k, v, src, dst)
    root = case.seq_lens_l[0] - 9
    keys, values = gather_paged_kv_nhd(k, v, case.block_table[0], root + 4)
    ok, ov = gather_paged_kv_nhd(k0, v0, case.block_table[0], case.seq_lens_l[0])
    idx = torch.tensor(list(range(root)) + [root + i for i in (0, 2, 5, 7)])
    assert torch.equal(keys, ok[idx]) and torch.equal(values, ov[idx])


def test_compact_kv_rejects_bad_input():
    k = torch.zeros(4, 16, 2, 32)
    s = torch.tensor([1, 2])
    with pytest.raises(ValueError):
        compact_kv_nhd(k, k[:2], s, s)
    with pytest.raises(ValueError):
        compact_kv_nhd(k, k, s, s[:1])
    with pytest.raises(ValueError):
        compact_kv_nhd(k, k, s.float(), s)
    with pytest.raises(ValueError):
        compact_kv_stacked(k, s, s)
    with pytest.raises(ValueError):
        compact_kv_stacked(torch.zeros(3, 4, 16, 2, 32), s, s)
