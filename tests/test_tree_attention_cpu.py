"""CPU tree attention: paged-cache reader, torch reference vs vLLM's kernel, and the impl.

Drives vLLM 0.32's CPU attention ops and ``CPUAttentionBackendImpl`` directly on small random
tensors (no engine). Metadata comes from vLLM's own ``CPUAttentionMetadataBuilder.build`` run on a
hand-made ``CommonAttentionMetadata``.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

ops = pytest.importorskip("vllm._custom_ops")

import vllm.v1.attention.backends.cpu_attn as cpu_attn  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import (  # noqa: E402
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
    _get_attn_isa,
)

import vllm_ddtree.attention.cpu as cpu_backend  # noqa: E402
import vllm_ddtree.attention.paged as paged  # noqa: E402
from vllm_ddtree.attention.common import (  # noqa: E402
    TreeAttentionBatch,
    TreeAttentionRequest,
    tree_attention_active,
)
from vllm_ddtree.attention.cpu import (  # noqa: E402
    DDTreeCPUAttentionBackend,
    DDTreeCPUAttentionImpl,
)
from vllm_ddtree.attention.paged import (  # noqa: E402
    MATMUL_MAX_ROWS,
    attend_paged_heads,
    gather_paged_kv,
    paged_head_rows,
    tree_attention_reference,
)

LAYER_NAME = "model.layers.0.self_attn.attn"


# --------------------------------------------------------------------------- helpers
def make_kv_cache(num_blocks, num_kv_heads, block_size, head_size, dtype, fill=True):
    """A CPU_ATTN cache ``[nb, Hkv, bs, 2D]`` plus vLLM's key/value views of it."""
    if fill:  # garbage everywhere, so reading a wrong block cannot pass by accident
        kv = torch.randn(num_blocks, num_kv_heads, block_size, 2 * head_size).to(dtype)
    else:
        kv = torch.zeros(num_blocks, num_kv_heads, block_size, 2 * head_size, dtype=dtype)
    key_cache, value_cache = kv.view(num_blocks, num_kv_heads, 2 * block_size, head_size).chunk(
        2, dim=2
    )
    return kv, key_cache, value_cache


def slots_for(block_row, positions, block_size):
    positions = torch.as_tensor(positions, dtype=torch.long)
    return block_row.long()[positions // block_size] * block_size + positions % block_size


def parents_to_mask(parents):
    """Ancestor-or-self mask of a tree given in topological order (``parents[0] == -1``)."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        mask[i, i] = True
        if p >= 0:
            assert p < i
            mask[i] |= mask[p]
    return mask


def fake_layer(isa):
    return SimpleNamespace(isa=isa, _k_scale_float=1.0, _v_scale_float=1.0, layer_name=LAYER_NAME)


@pytest.fixture
def model_dtype(monkeypatch):
    """``CPUAttentionBackendImpl.__init__`` reads ``get_current_vllm_config().model_config.dtype``
    (only to decide on zentorch encoder SDPA); give it a minimal stand-in."""
    holder = {"dtype": torch.float32}

    def fake_config():
        return SimpleNamespace(model_config=SimpleNamespace(dtype=holder["dtype"]))

    monkeypatch.setattr(cpu_attn, "get_current_vllm_config", fake_config)
    return holder


def make_impls(num_heads, head_size, num_kv_heads, **kwargs):
    args = (num_heads, head_size, head_size**-0.5, num_kv_heads,
            kwargs.pop("alibi_slopes", None), kwargs.pop("sliding_window", None),
            kwargs.pop("kv_cache_dtype", "auto"))
    return DDTreeCPUAttentionImpl(*args, **kwargs), CPUAttentionBackendImpl(*args, **kwargs)


def build_metadata(*, query_lens, seq_lens, block_table, slot_mapping, num_heads, num_kv_heads,
                   head_size, block_size, dtype, isa):
    """Run vLLM's ``CPUAttentionMetadataBuilder.build`` on a hand-made CommonAttentionMetadata.

    The builder's ``__init__`` needs a full VllmConfig with registered layers, so its instance
    attributes are set directly; ``build`` itself is vLLM's code.
    """
    builder = object.__new__(CPUAttentionMetadataBuilder)
    builder.num_heads = num_heads
    builder.num_kv_heads = num_kv_heads
    builder.head_dim = head_size
    builder.dtype = dtype
    builder.window_size = -1
    builder.block_size = block_size
    builder.kv_cache_dtype = "auto"
    builder.isa = isa
    builder.is_cross_attention = False
    builder.is_encoder_only_attention = False
    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens, dtype=torch.int32), 0)
    cad = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=len(query_lens),
        num_actual_tokens=int(qsl[-1]),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=block_table,
        slot_mapping=slot_mapping,
        causal=True,
    )
    return builder.build(0, cad)


@dataclass
class Scenario:
    """A step with several requests: committed prefix K/V already in the cache, fresh rows."""

    kv_cache: torch.Tensor
    block_table: torch.Tensor
    context_lens: list[int]
    query_lens: list[int]
    prefix_k: list[torch.Tensor]  # per request [ctx, Hkv, D]
    prefix_v: list[torch.Tensor]
    query: torch.Tensor  # [T_padded, H, D]
    key: torch.Tensor  # [T_padded, Hkv, D]
    value: torch.Tensor
    slot_mapping: torch.Tensor  # [T_actual]
    query_start: list[int]
    metadata: object
    isa: str


def make_scenario(context_lens, query_lens, *, num_heads=4, num_kv_heads=2, head_size=32,
                  block_size=32, dtype=torch.float32, pad_tokens=0, seed=0):
    torch.manual_seed(seed)
    isa = _get_attn_isa(dtype, block_size, head_size, "auto")
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    max_blocks = max(blocks_per_req) + 1
    num_blocks = sum(blocks_per_req) + 5
    perm = torch.randperm(num_blocks)  # scattered, non-monotone block ids
    block_table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    used = 0
    for r, nb in enumerate(blocks_per_req):
        block_table[r, :nb] = perm[used:used + nb].to(torch.int32)
        used += nb
    kv, key_cache, value_cache = make_kv_cache(num_blocks, num_kv_heads, block_size, head_size,
                                               dtype)
    prefix_k, prefix_v = [], []
    for r, ctx in enumerate(context_lens):
        k = torch.randn(ctx, num_kv_heads, head_size).to(dtype)
        v = torch.randn(ctx, num_kv_heads, head_size).to(dtype)
        if ctx:
            ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache,
                                           slots_for(block_table[r], range(ctx), block_size), isa)
        prefix_k.append(k)
        prefix_v.append(v)
    total = sum(query_lens)
    query = torch.randn(total + pad_tokens, num_heads, head_size).to(dtype)
    key = torch.randn(total + pad_tokens, num_kv_heads, head_size).to(dtype)
    value = torch.randn(total + pad_tokens, num_kv_heads, head_size).to(dtype)
    slot_mapping = torch.cat([
        slots_for(block_table[r], range(c, c + q), block_size)
        for r, (c, q) in enumerate(zip(context_lens, query_lens))
    ])
    query_start = [0]
    for q in query_lens:
        query_start.append(query_start[-1] + q)
    metadata = build_metadata(
        query_lens=query_lens, seq_lens=seq_lens, block_table=block_table,
        slot_mapping=slot_mapping, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_size=head_size, block_size=block_size, dtype=dtype, isa=isa,
    )
    return Scenario(kv, block_table, list(context_lens), list(query_lens), prefix_k, prefix_v,
                    query, key, value, slot_mapping, query_start, metadata, isa)


def run_impl(impl, sc, kv_cache, *, output_2d=False):
    layer = fake_layer(sc.isa)
    num_tokens, num_heads, head_size = sc.query.shape
    shape = (num_tokens, num_heads * head_size) if output_2d else (num_tokens, num_heads,
                                                                   head_size)
    output = torch.full(shape, 7.0, dtype=sc.query.dtype)
    n_act = sc.metadata.num_actual_tokens
    impl.do_kv_cache_update(layer, sc.key[:n_act], sc.value[:n_act], kv_cache, sc.slot_mapping)
    result = impl.forward(layer, sc.query, sc.key, sc.value, kv_cache, sc.metadata, output)
    assert result is output
    return output.view(num_tokens, num_heads, head_size)


# --------------------------------------------------------------------------- gather_paged_kv
GATHER_CASES = [
    ("vec", 32, 32, torch.float32),
    ("vec", 64, 64, torch.bfloat16),
    ("vec", 128, 32, torch.float16),
    ("vec16", 48, 16, torch.float32),
    ("vec16", 80, 32, torch.bfloat16),
    ("vec16", 32, 16, torch.float32),
    ("amx", 64, 32, torch.bfloat16),
    ("amx", 128, 64, torch.bfloat16),
]


@pytest.mark.parametrize("isa,head_size,block_size,dtype", GATHER_CASES)
def test_gather_paged_kv_reads_what_the_writer_wrote(isa, head_size, block_size, dtype):
    torch.manual_seed(1)
    num_kv_heads, num_blocks = 3, 11
    num_tokens = 3 * block_size + 5  # spans four blocks, last one partial
    block_row = torch.tensor([7, 2, 10, 4, 0, 0], dtype=torch.int32)
    kv, key_cache, value_cache = make_kv_cache(num_blocks, num_kv_heads, block_size, head_size,
                                               dtype)
    keys = torch.randn(num_tokens, num_kv_heads, head_size).to(dtype)
    values = torch.randn(num_tokens, num_kv_heads, head_size).to(dtype)
    # write in a shuffled token order, as a mixed batch would
    order = torch.randperm(num_tokens)
    try:
        ops.cpu_attn_reshape_and_cache(keys[order], values[order], key_cache, value_cache,
                                       slots_for(block_row, order, block_size), isa)
    except RuntimeError as exc:  # the writer for this ISA is not built / not runnable here
        pytest.skip(f"cpu_attn_reshape_and_cache({isa!r}) unavailable: {exc}")

    got_k, got_v = gather_paged_kv(key_cache, value_cache, block_row, num_tokens, isa)
    assert got_k.shape == (num_tokens, num_kv_heads, head_size) and got_k.dtype == dtype
    assert torch.equal(got_k, keys)
    assert torch.equal(got_v, values)
    part_k, part_v = gather_paged_kv(key_cache, value_cache, block_row, block_size + 3, isa)
    assert torch.equal(part_k, keys[:block_size + 3]) and torch.equal(part_v,
                                                                      values[:block_size + 3])
    empty_k, empty_v = gather_paged_kv(key_cache, value_cache, block_row, 0, isa)
    assert empty_k.shape == (0, num_kv_heads, head_size) and empty_v.shape == empty_k.shape
    # the reader must not have touched the cache
    assert torch.equal(kv.view(num_blocks, num_kv_heads, 2 * block_size, head_size).chunk(
        2, dim=2)[0], key_cache)


@pytest.mark.parametrize("chunk_bytes", [None, 1])
@pytest.mark.parametrize("rows", [5, MATMUL_MAX_ROWS, MATMUL_MAX_ROWS + 3])
@pytest.mark.parametrize("isa,head_size,block_size,dtype", GATHER_CASES)
def test_attend_paged_heads_equals_dense_attention_over_what_the_writer_wrote(
        isa, head_size, block_size, dtype, rows, chunk_bytes, monkeypatch):
    """Two requests whose blocks lie shuffled in the cache (the second's partly shared with the
    first), two KV heads, a random visibility mask per row: the result equals dense float32
    attention over the keys and values written by vLLM's writer (float32 also for bf16 / fp16
    caches, and for the tiled ``amx`` layout), on both sides of ``MATMUL_MAX_ROWS`` (explicit
    matmuls on the key blocks, and one SDPA call), with both requests gathered together and one
    at a time (``GATHER_CHUNK_BYTES``)."""
    if chunk_bytes is not None:
        monkeypatch.setattr(paged, "GATHER_CHUNK_BYTES", chunk_bytes)
    torch.manual_seed(2)
    num_kv_heads, num_blocks, m = 2, 9, 3
    kv, key_cache, value_cache = make_kv_cache(num_blocks, num_kv_heads, block_size, head_size,
                                               dtype)
    table = torch.tensor([[6, 1, 4], [4, 8, 2]], dtype=torch.int32)
    seq = m * block_size
    keys = torch.randn(2, seq, num_kv_heads, head_size).to(dtype)
    values = torch.randn(2, seq, num_kv_heads, head_size).to(dtype)
    try:  # request 1 owns blocks 8 and 2; its block 0 is request 0's last block (shared)
        ops.cpu_attn_reshape_and_cache(keys[0], values[0], key_cache, value_cache,
                                       slots_for(table[0], range(seq), block_size), isa)
        own = torch.arange(block_size, seq)
        ops.cpu_attn_reshape_and_cache(keys[1, own], values[1, own], key_cache, value_cache,
                                       slots_for(table[1], own, block_size), isa)
    except RuntimeError as exc:
        pytest.skip(f"cpu_attn_reshape_and_cache({isa!r}) unavailable: {exc}")
    keys[1, :block_size] = keys[0, 2 * block_size:]
    values[1, :block_size] = values[0, 2 * block_size:]
    visible = torch.rand(2, 1, rows, seq) < 0.5
    visible[..., 0] = True  # every row sees a key
    bias = torch.zeros(2, 1, rows, seq).masked_fill(~visible, float("-inf"))
    query = torch.randn(2, num_kv_heads, rows, head_size)
    scale = head_size ** -0.5
    key_rows, value_rows = paged_head_rows(table, num_kv_heads)
    got = attend_paged_heads(query, kv, key_rows, value_rows, bias, scale, isa)
    assert got.shape == (2, num_kv_heads, rows, head_size) and got.dtype == torch.float32
    k = keys.float().permute(0, 2, 1, 3)  # [2, Hkv, S, D]
    v = values.float().permute(0, 2, 1, 3)
    scores = (query @ k.transpose(-1, -2)) * scale + bias
    want = torch.softmax(scores, -1) @ v
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # a wrong block anywhere moves the result far beyond that tolerance
    moved = attend_paged_heads(query, kv, *paged_head_rows(table.flip(1), num_kv_heads), bias,
                               scale, isa)
    assert (moved - want).abs().max() > 1e-2
    with pytest.raises(NotImplementedError, match="not been verified"):
        attend_paged_heads(query, kv, key_rows, value_rows, bias, scale, "neon")
    empty = attend_paged_heads(query[:0], kv, key_rows[:0], value_rows[:0], bias[:0, ..., :0],
                               scale, isa)  # no request: no blocks
    assert empty.shape == (0, num_kv_heads, rows, head_size)
    with pytest.raises(ValueError, match="do not fit"):
        attend_paged_heads(query, kv, key_rows, value_rows, bias[..., :-1], scale, isa)


def test_gather_paged_kv_refuses_unverified_layouts():
    _, key_cache, value_cache = make_kv_cache(4, 2, 32, 32, torch.float32)
    row = torch.tensor([0, 1], dtype=torch.int32)
    for isa in ("neon", "rvv", "vxe", "vsx", "bogus"):
        with pytest.raises(NotImplementedError, match=repr(isa)):
            gather_paged_kv(key_cache, value_cache, row, 10, isa)
    with pytest.raises(NotImplementedError, match="amx"):  # amx verified for bf16 only
        gather_paged_kv(key_cache, value_cache, row, 10, "amx")
    fp8 = key_cache.to(torch.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match="fp8"):
        gather_paged_kv(fp8, fp8, row, 10, "vec")
    with pytest.raises(ValueError, match="blocks"):
        gather_paged_kv(key_cache, value_cache, row, 65, "vec")


# --------------------------------------------------------------------------- reference vs vLLM
@pytest.mark.parametrize("head_size,block_size", [(32, 32), (48, 16)])
def test_reference_with_chain_mask_equals_vllm_causal(head_size, block_size):
    context_lens = [0, 37, 70, 64]
    query_lens = [5, 1, 9, 4]
    sc = make_scenario(context_lens, query_lens, head_size=head_size, block_size=block_size,
                       num_heads=6, num_kv_heads=2)
    key_cache, value_cache = sc.kv_cache.view(sc.kv_cache.shape[0], 2, 2 * block_size,
                                              head_size).chunk(2, dim=2)
    n_act = sc.metadata.num_actual_tokens
    ops.cpu_attn_reshape_and_cache(sc.key[:n_act], sc.value[:n_act], key_cache, value_cache,
                                   sc.slot_mapping, sc.isa)
    out = torch.zeros_like(sc.query)
    md = sc.metadata
    ops.cpu_attention_with_kv_cache(
        query=sc.query, key_cache=key_cache, value_cache=value_cache, output=out,
        query_start_loc=md.query_start_loc, seq_lens=md.seq_lens, scale=head_size**-0.5,
        causal=True, alibi_slopes=None, sliding_window=-1, block_table=md.block_table,
        softcap=0.0, scheduler_metadata=md.scheduler_metadata, s_aux=None,
    )
    for r, (ctx, n) in enumerate(zip(context_lens, query_lens)):
        rows = slice(sc.query_start[r], sc.query_start[r] + n)
        keys, values = gather_paged_kv(key_cache, value_cache, sc.block_table[r], ctx + n, sc.isa)
        chain = torch.tril(torch.ones(n, n, dtype=torch.bool))
        ref = tree_attention_reference(sc.query[rows], keys, values, ctx, chain, head_size**-0.5)
        torch.testing.assert_close(ref, out[rows], rtol=1e-5, atol=1e-5)


def test_masking_an_ancestor_changes_exactly_the_rows_that_saw_it():
    torch.manual_seed(3)
    ctx, parents = 13, [-1, 0, 0, 1, 1, 2, 3, 5]
    n, heads, kv_heads, d = len(parents), 4, 1, 32
    q = torch.randn(n, heads, d)
    k = torch.randn(ctx + n, kv_heads, d)
    v = torch.randn(ctx + n, kv_heads, d)
    mask = parents_to_mask(parents)
    base = tree_attention_reference(q, k, v, ctx, mask, d**-0.5)

    # drop one ancestor (node 1) from one row (node 6, path 0-1-3-6): only row 6 changes
    m1 = mask.clone()
    m1[6, 1] = False
    out1 = tree_attention_reference(q, k, v, ctx, m1, d**-0.5)
    changed = (out1 - base).abs().amax(dim=(1, 2)) > 1e-6
    assert changed.tolist() == [i == 6 for i in range(n)]
    assert torch.equal(out1[~changed], base[~changed])

    # hide node 1 from everyone: exactly its descendants (1, 3, 4, 6) change
    m2 = mask.clone()
    m2[:, 1] = False
    out2 = tree_attention_reference(q, k, v, ctx, m2, d**-0.5)
    changed = (out2 - base).abs().amax(dim=(1, 2)) > 1e-6
    assert changed.tolist() == mask[:, 1].tolist()
    assert torch.equal(out2[~changed], base[~changed])

    # a sibling branch never influences a row: row 5 (path 0-2-5) ignores keys of nodes 1, 3
    k2 = k.clone()
    k2[ctx + 1] += 5.0
    k2[ctx + 3] -= 5.0
    out3 = tree_attention_reference(q, k2, v, ctx, mask, d**-0.5)
    assert torch.equal(out3[[0, 2, 5, 7]], base[[0, 2, 5, 7]])
    assert not torch.allclose(out3[[1, 3, 4, 6]], base[[1, 3, 4, 6]])


def test_reference_validates_inputs():
    q, k = torch.randn(3, 4, 8), torch.randn(5, 2, 8)
    m = torch.ones(3, 3, dtype=torch.bool)
    with pytest.raises(ValueError):
        tree_attention_reference(q, k, k, 1, m, 1.0)  # S != ctx + n
    with pytest.raises(ValueError):
        tree_attention_reference(torch.randn(3, 3, 8), k, k, 2, m, 1.0)  # 3 % 2 heads
    with pytest.raises(ValueError):
        tree_attention_reference(q, k[:3], k[:3], 0, torch.zeros(3, 3, dtype=torch.bool), 1.0)
    out = tree_attention_reference(q.bfloat16(), k, k, 2, m, 1.0)
    assert out.dtype == torch.bfloat16 and out.shape == (3, 4, 8)


# --------------------------------------------------------------------------- the impl
def test_backend_class_is_cpu_attn_with_our_impl():
    assert issubclass(DDTreeCPUAttentionBackend, CPUAttentionBackend)
    assert DDTreeCPUAttentionBackend.get_name() == "CPU_ATTN"
    assert DDTreeCPUAttentionBackend.get_impl_cls() is DDTreeCPUAttentionImpl
    assert DDTreeCPUAttentionBackend.get_builder_cls() is CPUAttentionBackend.get_builder_cls()
    assert DDTreeCPUAttentionBackend.get_supported_head_sizes() == \
        CPUAttentionBackend.get_supported_head_sizes()
    assert DDTreeCPUAttentionBackend.forward_includes_kv_cache_update is False
    assert DDTreeCPUAttentionBackend.supported_kv_cache_layouts() == \
        CPUAttentionBackend.supported_kv_cache_layouts()


E2E_CASES = [
    # head_size, block_size, dtype, output_2d
    (32, 32, torch.float32, False),
    (32, 32, torch.float32, True),
    (48, 16, torch.float32, False),  # vec16
    (64, 32, torch.bfloat16, False),
]


@pytest.mark.parametrize("head_size,block_size,dtype,output_2d", E2E_CASES)
def test_impl_tree_rows_use_ancestor_mask_others_match_vllm(model_dtype, head_size, block_size,
                                                             dtype, output_2d):
    model_dtype["dtype"] = dtype
    heads, kv_heads = 4, 2
    tree1 = [-1, 0, 0, 1, 1, 2, 3]  # branching: two children of the root, ...
    tree3 = [-1, 0, 1, 0, 3]
    #            decode  tree1       chunked prefill  tree3 (root at a block boundary)
    context_lens = [20, 45, 10, 2 * block_size]
    query_lens = [1, len(tree1), 6, len(tree3)]
    sc = make_scenario(context_lens, query_lens, num_heads=heads, num_kv_heads=kv_heads,
                       head_size=head_size, block_size=block_size, dtype=dtype, pad_tokens=3)
    masks = {1: parents_to_mask(tree1), 3: parents_to_mask(tree3)}
    requests = [
        TreeAttentionRequest(batch_index=r, query_start=sc.query_start[r], num_rows=query_lens[r],
                             context_len=context_lens[r], ancestor_mask=masks[r])
        for r in (1, 3)
    ]
    tree_rows = torch.cat([torch.arange(q.query_start, q.query_start + q.num_rows)
                           for q in requests])
    batch = TreeAttentionBatch(requests=requests, tree_rows=tree_rows)
    ours, vllms = make_impls(heads, head_size, kv_heads)

    kv_ours, kv_vllm = sc.kv_cache.clone(), sc.kv_cache.clone()
    with tree_attention_active(batch):
        out = run_impl(ours, sc, kv_ours, output_2d=output_2d)
    expected = run_impl(vllms, sc, kv_vllm, output_2d=output_2d)

    assert torch.equal(kv_ours, kv_vllm)  # identical KV writes
    tree_mask = torch.zeros(sc.query.shape[0], dtype=torch.bool)
    tree_mask[tree_rows] = True
    # non-tree rows (decode, chunked prefill, padding) are vLLM's result, bit for bit
    assert torch.equal(out[~tree_mask], expected[~tree_mask])

    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for req in requests:
        rows = slice(req.query_start, req.query_start + req.num_rows)
        b = req.batch_index
        keys = torch.cat([sc.prefix_k[b], sc.key[rows]])
        values = torch.cat([sc.prefix_v[b], sc.value[rows]])
        ref = tree_attention_reference(sc.query[rows], keys, values, req.context_len,
                                       req.ancestor_mask, head_size**-0.5)
        torch.testing.assert_close(out[rows], ref, **tol)
        # rows whose ancestor set is not the causal prefix really differ from vLLM's causal result
        non_chain = ~(req.ancestor_mask == torch.tril(torch.ones_like(req.ancestor_mask))).all(1)
        assert non_chain.any()
        diff = (out[rows][non_chain].float() - expected[rows][non_chain].float()).abs().amax()
        assert diff > 1e-2
        # chain rows (the root and first-child path) agree with the causal kernel
        torch.testing.assert_close(out[rows][~non_chain], expected[rows][~non_chain], **tol)

    layer, impl, rec_k, rec_v, rec_cache = batch.recorded_kv[LAYER_NAME]
    assert impl is ours and layer.isa == sc.isa and rec_cache is kv_ours
    assert torch.equal(rec_k, sc.key[tree_rows]) and torch.equal(rec_v, sc.value[tree_rows])


def test_vllm_kernel_skips_off_spine_rows_only_where_the_tree_ends_its_request(model_dtype):
    """vLLM's causal kernel runs without the off-spine rows of a tree that ends its request's
    query (here after two plain rows of the same request), and with all rows of a request whose
    tree is followed by more rows (those rows see the tree's keys); either way plain rows keep
    vLLM's bits and tree rows equal the ancestor-only reference."""
    model_dtype["dtype"] = torch.float32
    tree = [-1, 0, 1, 0, 3, 3]  # spine 0-1-2; rows 3, 4, 5 off it
    lead, trail = 2, 2
    context_lens, query_lens = [30, 41], [lead + len(tree), len(tree) + trail]
    sc = make_scenario(context_lens, query_lens, pad_tokens=1, seed=5)
    starts = [sc.query_start[0] + lead, sc.query_start[1]]
    requests = [TreeAttentionRequest(batch_index=r, query_start=starts[r], num_rows=len(tree),
                                     context_len=context_lens[r] + (lead if r == 0 else 0),
                                     ancestor_mask=parents_to_mask(tree)) for r in (0, 1)]
    tree_rows = torch.cat([torch.arange(q.query_start, q.query_start + q.num_rows)
                           for q in requests])
    batch = TreeAttentionBatch(requests=requests, tree_rows=tree_rows)
    ours, vllms = make_impls(4, 32, 2)
    kv_ours, kv_vllm = sc.kv_cache.clone(), sc.kv_cache.clone()
    with tree_attention_active(batch):
        out = run_impl(ours, sc, kv_ours)
    expected = run_impl(vllms, sc, kv_vllm)
    spine = next(v[1] for k, v in batch.backend_cache.items() if k[1] == "cpu_spine")
    off = [3, 4, 5]
    assert spine.metadata.query_start_loc.tolist() == [0, query_lens[0] - 3,
                                                       sum(query_lens) - 3]
    assert spine.metadata.seq_lens.tolist() == [context_lens[0] + query_lens[0] - 3,
                                                context_lens[1] + query_lens[1]]
    assert spine.keep.tolist() == [i for i in range(sum(query_lens))
                                   if i - starts[0] not in off]
    tree_mask = torch.zeros(sc.query.shape[0], dtype=torch.bool)
    tree_mask[tree_rows] = True
    assert torch.equal(out[~tree_mask], expected[~tree_mask])
    for req in requests:
        rows = slice(req.query_start, req.query_start + req.num_rows)
        q_lo = sc.query_start[req.batch_index]
        before = slice(q_lo, req.query_start)  # plain rows of the request before its tree
        keys = torch.cat([sc.prefix_k[req.batch_index], sc.key[before], sc.key[rows]])
        values = torch.cat([sc.prefix_v[req.batch_index], sc.value[before], sc.value[rows]])
        ref = tree_attention_reference(sc.query[rows], keys, values, req.context_len,
                                       req.ancestor_mask, 32**-0.5)
        torch.testing.assert_close(out[rows], ref, rtol=1e-5, atol=1e-5)
        assert torch.equal(out[rows][:3], expected[rows][:3])  # the spine


def test_impl_without_active_batch_is_vllm(model_dtype):
    sc = make_scenario([20, 45, 0], [1, 7, 5], pad_tokens=2, seed=5)
    ours, vllms = make_impls(4, 32, 2)
    kv_ours, kv_vllm = sc.kv_cache.clone(), sc.kv_cache.clone()
    out = run_impl(ours, sc, kv_ours)
    expected = run_impl(vllms, sc, kv_vllm)
    assert torch.equal(out, expected) and torch.equal(kv_ours, kv_vllm)
    # an active batch without tree requests changes nothing either
    kv_ours2 = sc.kv_cache.clone()
    with tree_attention_active(TreeAttentionBatch(requests=[])):
        out2 = run_impl(ours, sc, kv_ours2)
    assert torch.equal(out2, expected) and torch.equal(kv_ours2, kv_vllm)
    # warm-up call (no metadata) returns output untouched, as vLLM does
    output = torch.full((3, 4, 32), 7.0)
    with tree_attention_active(TreeAttentionBatch(requests=[])):
        assert ours.forward(fake_layer(sc.isa), sc.query[:3], sc.key[:3], sc.value[:3],
                            kv_ours, None, output) is output
    assert (output == 7.0).all()


def _one_tree_batch(sc, r=1):
    return TreeAttentionBatch(requests=[TreeAttentionRequest(
        batch_index=r, query_start=sc.query_start[r], num_rows=sc.query_lens[r],
        context_len=sc.context_lens[r], ancestor_mask=parents_to_mask([-1, 0, 0, 1]))])


@pytest.mark.parametrize("feature,kwargs", [
    ("sliding window", dict(sliding_window=16)),
    ("ALiBi", dict(alibi_slopes=[0.5, 0.25, 0.125, 0.0625])),
    ("logits soft cap", dict(logits_soft_cap=30.0)),
    ("attention sinks", dict(sinks=torch.zeros(4))),
    ("fp8 KV cache", dict(kv_cache_dtype="fp8")),
])
def test_impl_refuses_unsupported_features_on_tree_rows(model_dtype, feature, kwargs):
    sc = make_scenario([20, 30], [1, 4])
    ours, _ = make_impls(4, 32, 2, **kwargs)
    output = torch.zeros_like(sc.query)
    with tree_attention_active(_one_tree_batch(sc)):
        with pytest.raises(NotImplementedError, match=feature):
            ours.forward(fake_layer(sc.isa), sc.query, sc.key, sc.value, sc.kv_cache,
                         sc.metadata, output)


def test_impl_rejects_tree_inconsistent_with_metadata(model_dtype):
    sc = make_scenario([20, 30], [1, 4])
    ours, _ = make_impls(4, 32, 2)
    layer, output = fake_layer(sc.isa), torch.zeros_like(sc.query)
    bad_ctx = _one_tree_batch(sc)
    bad_ctx.requests[0].context_len = 29
    bad_rows = _one_tree_batch(sc)
    bad_rows.requests[0].query_start = 0
    for batch, match in ((bad_ctx, "position"), (bad_rows, "inside")):
        with tree_attention_active(batch), pytest.raises(ValueError, match=match):
            ours.forward(layer, sc.query, sc.key, sc.value, sc.kv_cache, sc.metadata, output)


# ------------------------------------------------------------------- off-spine rows and chains
from vllm_ddtree.attention.cpu import off_spine_rows, tree_chains  # noqa: E402

TREES = {
    "chain": [-1, 0, 1, 2, 3],
    "bushy": [-1, 0, 0, 0, 0, 0, 0, 1, 1, 2],  # six children of the root
    "deep": [-1, 0, 1, 2, 3, 4, 5, 0, 7, 8, 9, 10, 3, 12],  # two long branches and a late fork
    "leaves": [-1, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 6, 7, 0, 13],  # binary-ish, many leaves
    "spine_then_fork": [-1, 0, 1, 2, 3, 3, 3],  # the first rows are the causal prefix
}


def _path(parents, i):
    path = [i]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


@pytest.mark.parametrize("name", sorted(TREES))
def test_tree_chains_cover_every_non_prefix_row_once_as_path_suffixes(name):
    parents = TREES[name]
    mask = parents_to_mask(parents)
    n = len(parents)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    need = {i for i in range(n) if not torch.equal(mask[i], causal[i])}
    chains = tree_chains(mask)
    covered = []
    for path, first in chains:
        leaf = path[-1]
        assert path == _path(parents, leaf)  # a root→leaf path ...
        assert leaf not in parents  # ... ending at a leaf
        assert 0 <= first < len(path)
        covered += path[first:]
        assert all(j not in need for j in path[:first] if j not in covered)  # suffix: rest done
    assert sorted(covered) == sorted(need)  # each row to recompute exactly once
    depths = [len(p) for p, _ in chains]
    assert depths == sorted(depths, reverse=True)  # deepest leaf first
    if name == "chain":
        assert chains == []


def test_tree_chains_rejects_masks_that_are_not_trees():
    good = parents_to_mask([-1, 0, 1, 0])
    with pytest.raises(ValueError, match="tree"):
        tree_chains(good.t().contiguous())  # descendants instead of ancestors
    bad = good.clone()
    bad[3, 2] = True  # node 3 sees node 2 but not its parent 1: not an ancestor set
    with pytest.raises(ValueError, match="tree"):
        tree_chains(bad)
    bad = good.clone()
    bad[2, 2] = False
    with pytest.raises(ValueError, match="tree"):
        tree_chains(bad)


@pytest.mark.parametrize("name", sorted(TREES))
def test_off_spine_rows_are_the_rows_a_causal_query_gets_wrong(name):
    parents = TREES[name]
    mask = parents_to_mask(parents)
    n = len(parents)
    spine = [i for i in range(n) if _path(parents, i) == list(range(i + 1))]
    assert off_spine_rows(mask).tolist() == [i for i in range(n) if i not in spine]
    if name == "chain":
        assert off_spine_rows(mask).numel() == 0


def test_off_spine_rows_rejects_masks_that_are_not_ancestor_masks():
    good = parents_to_mask([-1, 0, 1, 0])
    with pytest.raises(ValueError, match="ancestor-or-self"):
        off_spine_rows(good.t().contiguous())  # descendants instead of ancestors
    bad = good.clone()
    bad[2, 2] = False
    with pytest.raises(ValueError, match="ancestor-or-self"):
        off_spine_rows(bad)
    with pytest.raises(ValueError, match=r"\[n, n\]"):
        off_spine_rows(good[:, :3])


def _per_node_kernel(sc, impl, requests, head_size, block_size):
    """The per-node method (one-token causal query per tree row over its ancestor path laid out
    in the tree's slots, through vLLM's kernel), applied to a copy of the cache."""
    kv = sc.kv_cache.clone()
    nb = kv.shape[0]
    kc, vc = kv.view(nb, kv.shape[1], 2 * block_size, head_size).chunk(2, dim=2)
    n_act = sc.metadata.num_actual_tokens
    ops.cpu_attn_reshape_and_cache(sc.key[:n_act], sc.value[:n_act], kc, vc, sc.slot_mapping,
                                   sc.isa)
    out = {}
    for req in requests:
        lo = req.query_start
        for i in range(req.num_rows):
            path = torch.nonzero(req.ancestor_mask[i]).flatten()
            ops.cpu_attn_reshape_and_cache(sc.key[lo + path], sc.value[lo + path], kc, vc,
                                           sc.slot_mapping[lo:lo + len(path)], sc.isa)
            res = torch.empty_like(sc.query[:1])
            qsl = torch.tensor([0, 1], dtype=torch.int32)
            lens = torch.tensor([req.context_len + len(path)], dtype=torch.int32)
            meta = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=1, num_heads=impl.num_heads, num_kv_heads=impl.num_kv_heads,
                head_dim=head_size, seq_lens=lens, dtype=sc.query.dtype, query_start_loc=qsl,
                causal=True, sliding_window_size=-1, isa=sc.isa, enable_kv_split=True,
                dynamic_causal=None, kv_cache_dtype="auto")
            ops.cpu_attention_with_kv_cache(
                query=sc.query[lo + i:lo + i + 1].contiguous(), key_cache=kc, value_cache=vc,
                output=res, query_start_loc=qsl, seq_lens=lens, scale=head_size**-0.5,
                causal=True, alibi_slopes=None, sliding_window=-1,
                block_table=sc.block_table[req.batch_index:req.batch_index + 1], softcap=0.0,
                scheduler_metadata=meta, s_aux=None)
            out[lo + i] = res[0]
            ops.cpu_attn_reshape_and_cache(sc.key[lo:lo + req.num_rows],
                                           sc.value[lo:lo + req.num_rows], kc, vc,
                                           sc.slot_mapping[lo:lo + req.num_rows], sc.isa)
    return out


@pytest.mark.parametrize("dtype,head_size,block_size,matmul_max_rows,path", [
    (torch.float32, 32, 16, None, "one call"),  # small blocks: paths cross block boundaries
    (torch.float32, 32, 16, 0, "one call"),  # through the SDPA branch of attend_paged_heads
    (torch.float32, 32, 16, None, "one call, a request per gather"),
    (torch.float32, 32, 16, None, "chains"),
    (torch.bfloat16, 64, 32, None, "one call"),
    (torch.bfloat16, 64, 32, 0, "one call"),
    (torch.bfloat16, 64, 32, None, "chains"),
    (torch.bfloat16, 128, 128, None, "one call"),  # the 0.6B head shape
])
def test_tree_rows_equal_reference_and_per_node_kernel(model_dtype, dtype, head_size,
                                                       block_size, matmul_max_rows, path,
                                                       monkeypatch):
    """Several requests of different tree shapes and sizes next to plain rows: tree rows equal
    the ancestor-only reference and vLLM's kernel run once per node over its ancestor path
    (fp32: to 1e-6; bf16: at most one bf16 ulp in an element, since vLLM's kernel rounds a row
    differently in different call shapes), both in one float32 call per layer and chain by chain
    through vLLM's kernel (the path of layouts outside ``ONE_CALL_ISAS``); spine rows and
    non-tree rows are vLLM's bits, the cache ends as vLLM leaves it, and every layer of the
    step reuses one plan."""
    model_dtype["dtype"] = dtype
    if matmul_max_rows is not None:
        monkeypatch.setattr(paged, "MATMUL_MAX_ROWS", matmul_max_rows)
    if path == "chains":
        monkeypatch.setattr(cpu_backend, "ONE_CALL_ISAS", ())
    else:  # these trees are small: bf16 would take the chains by default
        monkeypatch.setattr(cpu_backend, "LOW_PRECISION_ONE_CALL_MIN_ROWS", 0)
    if path.endswith("a request per gather"):
        monkeypatch.setattr(paged, "GATHER_CHUNK_BYTES", 1)
    heads, kv_heads = 8, 2
    names = ["bushy", None, "deep", "chain", "leaves", "spine_then_fork"]
    trees = {r: TREES[nm] for r, nm in enumerate(names) if nm}
    context_lens = [33, 20, 2 * block_size - 3, 70, block_size, 5]
    query_lens = [len(trees[r]) if r in trees else 3 for r in range(len(names))]
    sc = make_scenario(context_lens, query_lens, num_heads=heads, num_kv_heads=kv_heads,
                       head_size=head_size, block_size=block_size, dtype=dtype, pad_tokens=2,
                       seed=11)
    requests = [TreeAttentionRequest(batch_index=r, query_start=sc.query_start[r],
                                     num_rows=query_lens[r], context_len=context_lens[r],
                                     ancestor_mask=parents_to_mask(p)) for r, p in trees.items()]
    tree_rows = torch.cat([torch.arange(q.query_start, q.query_start + q.num_rows)
                           for q in requests])
    batch = TreeAttentionBatch(requests=requests, tree_rows=tree_rows)
    ours, vllms = make_impls(heads, head_size, kv_heads)
    kv_ours, kv_vllm = sc.kv_cache.clone(), sc.kv_cache.clone()
    with tree_attention_active(batch):
        out = run_impl(ours, sc, kv_ours)
        kv_again = sc.kv_cache.clone()
        out_again = run_impl(ours, sc, kv_again)  # a second layer with the same metadata
    assert [k[1] for k in batch.backend_cache] == [
        "cpu_off_spine", "cpu_spine",
        "cpu_tree_rows" if path.startswith("one call") else "cpu_waves"]
    plans = [v[1] for v in batch.backend_cache.values()][1:]
    # vLLM's kernel ran without the off-spine rows (recomputed anyway): every other row is kept.
    off_spine = sum(cpu_backend.off_spine_rows(q.ancestor_mask).numel() for q in requests)
    assert plans[0].metadata.num_actual_tokens == sc.metadata.num_actual_tokens - off_spine > 0
    assert plans[0].keep.numel() == plans[0].metadata.num_actual_tokens
    if path.endswith("a request per gather"):
        chunks = plans[1].chunks
        assert [c[3][0] for c in chunks] == [1] * sum(
            cpu_backend.off_spine_rows(q.ancestor_mask).numel() > 0 for q in requests)
    assert torch.equal(out_again, out) and torch.equal(kv_again, kv_ours)
    expected = run_impl(vllms, sc, kv_vllm)
    assert torch.equal(kv_ours, kv_vllm)
    per_node = _per_node_kernel(sc, vllms, requests, head_size, block_size)

    tree_mask = torch.zeros(sc.query.shape[0], dtype=torch.bool)
    tree_mask[tree_rows] = True
    assert torch.equal(out[~tree_mask], expected[~tree_mask])
    for req in requests:
        rows = slice(req.query_start, req.query_start + req.num_rows)
        b = req.batch_index
        ref = tree_attention_reference(
            sc.query[rows], torch.cat([sc.prefix_k[b], sc.key[rows]]),
            torch.cat([sc.prefix_v[b], sc.value[rows]]), req.context_len, req.ancestor_mask,
            head_size**-0.5)
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(out[rows], ref, **tol)
        prefix = (req.ancestor_mask == torch.ones_like(req.ancestor_mask).tril()).all(1)
        assert torch.equal(out[rows][prefix], expected[rows][prefix])  # not redone
        for i in range(req.num_rows):
            got, want = out[req.query_start + i].float(), per_node[req.query_start + i].float()
            if dtype == torch.float32:
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
            else:
                ulp = 2.0 ** -7 * torch.maximum(got.abs(), want.abs())
                assert ((got - want).abs() <= ulp).all(), (req.batch_index, i)


@pytest.mark.parametrize("dtype,rows,plan", [
    (torch.float32, 6, "cpu_tree_rows"),
    (torch.bfloat16, 6, "cpu_waves"),
    (torch.bfloat16, cpu_backend.LOW_PRECISION_ONE_CALL_MIN_ROWS, "cpu_tree_rows"),
])
def test_small_low_precision_trees_go_chain_by_chain(model_dtype, dtype, rows, plan):
    """float32 trees always take the one-call path; bf16 trees only from
    ``LOW_PRECISION_ONE_CALL_MIN_ROWS`` rows on (below, converting the gathered blocks costs more
    than vLLM's kernel per chain), and either way match the ancestor-only reference."""
    model_dtype["dtype"] = dtype
    parents = [-1] + [max(0, i - 2) for i in range(1, rows)]  # two interleaved branches
    sc = make_scenario([40], [rows], num_heads=4, num_kv_heads=2, head_size=64, block_size=32,
                       dtype=dtype, seed=3)
    req = TreeAttentionRequest(batch_index=0, query_start=0, num_rows=rows, context_len=40,
                               ancestor_mask=parents_to_mask(parents))
    batch = TreeAttentionBatch(requests=[req], tree_rows=torch.arange(rows))
    ours, _ = make_impls(4, 64, 2)
    with tree_attention_active(batch):
        out = run_impl(ours, sc, sc.kv_cache.clone())
    assert [k[1] for k in batch.backend_cache] == ["cpu_off_spine", "cpu_spine", plan]
    ref = tree_attention_reference(sc.query[:rows], torch.cat([sc.prefix_k[0], sc.key[:rows]]),
                                   torch.cat([sc.prefix_v[0], sc.value[:rows]]), 40,
                                   req.ancestor_mask, 64 ** -0.5)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out[:rows], ref, **tol)
