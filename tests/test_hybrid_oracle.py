"""The recurrent tree oracle, layer level: every node equals its root->node path run as a chain.

Pure torch (fp32 reference steps of GatedDeltaNet and Mamba2) for the tree walk, conv windows
and commit re-layout; then vLLM's own CPU GDN kernels through our glue, against vLLM's own
chain path on each path alone. End-to-end engines: tests/test_hybrid_e2e.py.
"""

from __future__ import annotations

import dataclasses
import random
import types

import pytest
import torch

from vllm_ddtree.hybrid.oracle import (
    build_recurrent_layout,
    commit_conv_buffer,
    commit_single_tokens,
    commit_states,
    conv_window_index,
    gated_delta_step_reference,
    gather_conv_windows,
    load_committed,
    mamba2_step_reference,
    path_layout,
    read_conv_windows,
    run_tree_levels,
    tree_causal_conv,
)


def random_parents(n: int, rng: random.Random) -> torch.Tensor:
    """Parents of a random tree of n + 1 nodes in pop order (parent index < child index)."""
    return torch.tensor([-1] + [rng.randrange(t) for t in range(1, n + 1)], dtype=torch.long)


def path_to(parents: torch.Tensor, node: int) -> list[int]:
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(int(parents[path[-1]]))
    return path[::-1]


class GDNKind:
    """fp32 GatedDeltaNet step on a [slots, H, K, V] state (reference math)."""

    H, K, V = 2, 8, 6

    def __init__(self, g):
        self.A_log, self.dt_bias = torch.randn(self.H, generator=g), torch.randn(self.H, generator=g)

    def state(self, n, g):
        return torch.randn(n, self.H, self.K, self.V, generator=g) * 0.3

    def inputs(self, T, g):
        return (torch.randn(T, self.H, self.K, generator=g), torch.randn(T, self.H, self.K, generator=g),
                torch.randn(T, self.H, self.V, generator=g), torch.randn(T, self.H, generator=g),
                torch.randn(T, self.H, generator=g))

    def step(self, state, inp):
        q, k, v, a, b = inp
        return gated_delta_step_reference(state, q, k, v, a, b, self.A_log, self.dt_bias)


class Mamba2Kind:
    """fp32 Mamba2 SSM step on a [slots, H, P, N] state (reference math)."""

    H, P, N, G = 4, 3, 5, 2

    def __init__(self, g):
        self.A = -torch.rand(self.H, generator=g) - 0.1
        self.D, self.dt_bias = torch.randn(self.H, generator=g), torch.randn(self.H, generator=g)

    def state(self, n, g):
        return torch.randn(n, self.H, self.P, self.N, generator=g) * 0.3

    def inputs(self, T, g):
        return (torch.randn(T, self.H, self.P, generator=g), torch.randn(T, self.H, generator=g),
                torch.randn(T, self.G, self.N, generator=g), torch.randn(T, self.G, self.N, generator=g))

    def step(self, state, inp):
        x, dt, B, C = inp
        return mamba2_step_reference(state, x, dt, self.A, B, C, self.D, self.dt_bias)


def _select(inp, rows):
    return tuple(t[rows] for t in inp)


def _advance(kind, inp):
    """The layer call's replay: the reference step in a level scratch (outputs optional)."""
    def advance(lay, scratch, out=None):
        def step(level, dst):
            new, o = kind.step(scratch[dst], _select(inp, level))
            scratch[dst] = new
            if out is not None:
                out[level] = o

        run_tree_levels(lay, scratch, step)

    return advance


def _random_tree(q, max_depth, rng):
    """Parents (pop order) of a tree of q nodes of depth <= max_depth."""
    parents, depth = [-1], [0]
    for t in range(1, q):
        p = rng.choice([i for i in range(t) if depth[i] < max_depth])
        parents.append(p)
        depth.append(depth[p] + 1)
    return torch.tensor(parents, dtype=torch.long)


@pytest.mark.parametrize("kind_cls", [GDNKind, Mamba2Kind])
@pytest.mark.parametrize("seed", range(6))
def test_tree_walk_equals_each_path_as_a_chain(kind_cls, seed):
    """Outputs of every node, and conv outputs over ancestor windows (incl. the committed
    window past the root), equal the root->node path run alone as a chain; committing any
    node's path writes that chain's state to block a and its conv window where the next step
    reads it. State blocks (C) are fewer than a tree's nodes: only the depth bounds them."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    kind = kind_cls(g)
    W, dim, C, K = 4, 7, 5, 16  # C = L + 1 state blocks, trees of up to K + 1 nodes
    sizes = [rng.randrange(2, K + 2), rng.randrange(2, C + 1), K + 1, 1]
    parents = {b: _random_tree(q, C - 1, rng) for b, q in enumerate(sizes) if b not in (1, 3)}
    N = len(sizes)
    slots = N * C + 1
    state_indices = (torch.randperm(slots - 1, generator=g) + 1).view(N, C).int()
    num_accepted = torch.tensor([1, 3, C, 2], dtype=torch.int32)
    lay = build_recurrent_layout(sizes, list(range(N)), state_indices, num_accepted, parents)
    T = lay.num_tokens
    assert lay.is_tree == [True, False, True, False]
    assert lay.num_scratch_rows < 1 + N + T or max(sizes) <= 2  # two levels, not every node

    states = kind.state(slots, g)
    committed = states.clone()
    inp = kind.inputs(T, g)
    out = torch.zeros(T, *kind.step(states[:1], _select(inp, [0]))[1].shape[1:])
    advance = _advance(kind, inp)
    scratch = load_committed(lay, states)
    advance(lay, scratch, out)
    assert torch.equal(states, committed)  # the forward writes no vLLM block
    assert commit_single_tokens(states, lay, scratch) == [3]

    x = torch.randn(T, dim, generator=g)
    conv_buf = torch.randn(slots, dim, W - 1 + C - 1, generator=g)
    weight, bias = torch.randn(dim, W, generator=g), torch.randn(dim, generator=g)
    prior = read_conv_windows(conv_buf, lay, W)
    conv = tree_causal_conv(x, gather_conv_windows(x, prior, conv_window_index(lay, W)),
                            weight, bias, "silu")

    def chain(n, path):
        st = committed[state_indices[n, int(num_accepted[n]) - 1].long()].unsqueeze(0)
        for t in path:
            st, o = kind.step(st, _select(inp, [t]))
        return st[0], o[0]

    nodes = {n: list(range(q)) for n, q in enumerate(sizes)}
    for rnd in range(max(sizes)):  # commit one node's path per sequence and round
        st, buf = committed.clone(), conv_buf.clone()
        paths = {n: path_to(parents.get(n, torch.arange(-1, q - 1)), nodes[n][rnd])
                 for n, q in enumerate(sizes) if rnd < q and n != 3}
        commit_states(st, lay, paths, advance)
        commit_conv_buffer(buf, lay, prior, x, paths)
        for n, path in paths.items():
            s, node = lay.seq_starts[n], path[-1]
            flat = [s + t for t in path]
            want_state, want_out = chain(n, flat)
            a = len(path) - 1
            torch.testing.assert_close(st[state_indices[n, a].long()], want_state,
                                       rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(out[s + node], want_out, rtol=1e-5, atol=1e-5)
            seq_in = torch.cat([prior[n], x[flat].T], dim=-1)  # the chain's conv input
            want = torch.nn.functional.silu(
                torch.nn.functional.conv1d(seq_in[None], weight[:, None], bias, groups=dim))[0, :, -1]
            torch.testing.assert_close(conv[s + node], want, rtol=1e-5, atol=1e-5)
            nxt = build_recurrent_layout([1], [0], state_indices[n : n + 1],
                                         torch.tensor([a + 1]), {})
            torch.testing.assert_close(read_conv_windows(buf, nxt, W)[0], seq_in[:, -(W - 1):])
        untouched = set(range(slots)) - {int(state_indices[n, len(p) - 1]) for n, p in paths.items()}
        assert torch.equal(st[sorted(untouched)], committed[sorted(untouched)])
    single = state_indices[3, 0].long()
    torch.testing.assert_close(states[single], chain(3, [lay.seq_starts[3]])[0], rtol=1e-5, atol=1e-5)


def test_conv_windows_reach_past_the_root():
    lay = build_recurrent_layout([3], [0], torch.arange(4).view(1, 4), torch.tensor([1]),
                                 {0: torch.tensor([-1, 0, 0])})
    T, m = 3, 3
    idx = conv_window_index(lay, m + 1)
    # root: the whole committed window; children: committed[1:], then the root.
    assert idx[0].tolist() == [T + 0, T + 1, T + 2]
    assert idx[1].tolist() == [T + 1, T + 2, 0] == idx[2].tolist()


def test_level_scratch_holds_two_levels_and_paths_chain_from_the_committed_copy():
    # star of 6 leaves under the root, then a chain of 2 below leaf 1: widths 1, 6, 1, 1
    parents = torch.tensor([-1, 0, 0, 0, 0, 0, 0, 1, 7])
    lay = build_recurrent_layout([9], [0], torch.arange(10, 14).view(1, 4), torch.tensor([2]),
                                 {0: parents})
    assert int(lay.committed_slots[0]) == 11
    assert lay.num_scratch_rows == 1 + 1 + 6 + 1  # null, committed copy, odd (6), even (1)
    assert int(lay.src_slots[0]) == int(lay.dst_slots[0]) == 1  # the root: its committed copy
    assert lay.dst_slots[8] == lay.dst_slots[1]  # depth 3 reuses depth 1's region
    chains = path_layout(lay, {0: [0, 1, 7, 8]})
    assert [lv.tolist() for lv in chains.levels] == [[0], [1], [7], [8]]
    assert chains.src_slots[[0, 1, 7, 8]].tolist() == chains.dst_slots[[0, 1, 7, 8]].tolist() == [1] * 4
    assert chains.num_scratch_rows == 2 and chains.src_slots[2] == -1
    with pytest.raises(ValueError, match="not a root-to-node path"):
        path_layout(lay, {0: [0, 2, 7]})
    with pytest.raises(RuntimeError, match="4 state blocks"):
        commit_states(torch.zeros(20, 2), lay, {0: [0, 1, 7, 8, 8]}, lambda *a: None)


def test_a_fresh_request_starts_from_zeros_not_its_recycled_blocks():
    """A new request's blocks hold a finished request's state; a fresh row (no computed
    tokens, e.g. a one-token prompt padded with placeholder drafts) reads zeros instead."""
    lay = build_recurrent_layout([2, 2], [0, 1], torch.arange(1, 9).view(2, 4),
                                 torch.tensor([1, 1]), {}, fresh_rows=frozenset({1}))
    assert lay.fresh == [False, True]
    states = torch.randn(9, 3)
    scratch = load_committed(lay, states)
    torch.testing.assert_close(scratch[1], states[1])
    assert torch.equal(scratch[2], torch.zeros(3))
    prior = read_conv_windows(torch.randn(9, 5, 6), lay, 4)
    assert prior[0].abs().sum() > 0 and torch.equal(prior[1], torch.zeros(5, 3))


def test_layout_refuses_a_tree_that_does_not_match_the_rows():
    with pytest.raises(RuntimeError, match="tree of 3 nodes"):
        build_recurrent_layout([2], [0], torch.arange(4).view(1, 4), torch.tensor([1]),
                               {0: torch.tensor([-1, 0, 0])})


# ----------------------------------------------------------------------------- vLLM GDN kernels


def _gdn_layer(Hk=2, Hv=4, D=128, W=4, seed=0):
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

    g = torch.Generator().manual_seed(seed)
    dim = 2 * Hk * D + Hv * D
    layer = types.SimpleNamespace(
        key_dim=Hk * D, value_dim=Hv * D, tp_size=1, head_k_dim=D, head_v_dim=D,
        A_log=torch.randn(Hv, generator=g), dt_bias=torch.randn(Hv, generator=g).bfloat16(),
        activation="silu",
        conv1d=types.SimpleNamespace(weight=torch.randn(dim, 1, W, generator=g).bfloat16(),
                                     bias=torch.randn(dim, generator=g).bfloat16()))
    layer.rearrange_mixed_qkv = types.MethodType(QwenGatedDeltaNetAttention.rearrange_mixed_qkv, layer)
    import vllm._custom_ops as ops
    from vllm.model_executor.layers.mamba.ops.cpu.gdn_attention import is_arm_bf16

    if (torch.cpu._is_avx512_bf16_supported() or is_arm_bf16()) and hasattr(
            ops, "causal_conv1d_weight_pack"):  # as vLLM packs it at load (layers/utils.py)
        w = layer.conv1d.weight
        layer.conv1d._cpu_unpacked_conv_weight = w.view(w.size(0), w.size(2)).contiguous().clone()
        layer.conv1d.weight = ops.causal_conv1d_weight_pack(layer.conv1d._cpu_unpacked_conv_weight)
    return layer, dim


def _gdn_meta(seq_lens, state_indices, num_accepted):
    qsl = torch.tensor([0] + list(torch.tensor(seq_lens).cumsum(0)), dtype=torch.int32)
    return types.SimpleNamespace(
        num_spec_decodes=len(seq_lens), spec_query_start_loc=qsl,
        spec_state_indices_tensor=state_indices.int(), num_accepted_tokens=num_accepted.int(),
        spec_sequence_masks=torch.ones(len(seq_lens), dtype=torch.bool))


@pytest.fixture(scope="module")
def vllm_gdn():
    pytest.importorskip("vllm")
    from vllm_ddtree.plugin import register

    register()
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

    if not hasattr(torch.ops._C, "fused_sigmoid_gating_delta_rule_update_cpu"):
        pytest.skip("vLLM CPU GDN kernels not built")
    return gdn_attention


def test_vllm_gdn_decode_kernel_matches_the_reference_step(vllm_gdn):
    """The kernel the oracle steps with is one GatedDeltaNet token, state in place."""
    import vllm._custom_ops as ops

    g = torch.Generator().manual_seed(1)
    n, H, D = 3, 4, 128
    state = torch.randn(6, H, D, D, generator=g) * 0.05
    q, k = (torch.randn(1, n, H, D, generator=g).bfloat16() for _ in range(2))
    v = torch.randn(1, n, H, D, generator=g).bfloat16()
    a, b = (torch.randn(n, H, generator=g).bfloat16() for _ in range(2))
    A_log, dt_bias = torch.randn(H, generator=g), torch.randn(H, generator=g).bfloat16()
    slots = torch.tensor([4, 1, 2], dtype=torch.int32)
    before = state.clone()
    o = ops.fused_sigmoid_gating_delta_rule_update_cpu(
        A_log=A_log, dt_bias=dt_bias, q=q, k=k, v=v, a=a, b=b, initial_state_source=state,
        initial_state_indices=slots, cu_seqlens=torch.arange(n + 1, dtype=torch.int32),
        use_qk_l2norm_in_kernel=True)
    want_state, want_o = gated_delta_step_reference(
        before[slots.long()], q[0], k[0], v[0], a, b, A_log, dt_bias)
    torch.testing.assert_close(state[slots.long()], want_state, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(o.reshape(n, H, D).float(), want_o, rtol=2e-2, atol=2e-3)
    untouched = [i for i in range(6) if i not in slots.tolist()]
    assert torch.equal(state[untouched], before[untouched])


@pytest.mark.parametrize("seed", range(3))
def test_gdn_tree_forward_equals_vllm_chain_on_each_path(vllm_gdn, seed, monkeypatch):
    """Our GDN glue over a batch of trees == vLLM's own speculative chain path run on each
    root->node path alone (same vLLM kernels underneath; fp32 recurrent state).

    vLLM's chain path is taken in its portable form (``F.conv1d`` over the unpacked weight, the
    ``(dim, state_len)`` window this test builds): on AMX / Arm-bf16 CPUs it would otherwise
    switch to its native conv kernel, which wants packed weights and the other window layout
    (``causal_conv1d_update_cpu: 3D x requires SD conv_states layout``); the engine tests cover
    those machines end to end."""
    from vllm_ddtree.hybrid.context import HybridTreeContext
    from vllm_ddtree.hybrid.gdn_cpu import tree_spec_forward

    monkeypatch.setattr(vllm_gdn.torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(vllm_gdn, "is_arm_bf16", lambda: False)

    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    layer, dim = _gdn_layer(seed=seed)
    W, K, Hv, D = 4, 6, 4, 128
    sizes = [K + 1, rng.randrange(1, K + 2)]
    parents = {0: random_parents(sizes[0] - 1, rng), 1: random_parents(sizes[1] - 1, rng)}
    idx = torch.tensor([[1 + i for i in range(K + 1)], [9 + i for i in range(K + 1)]])
    acc = torch.tensor([1, 4])
    slots = 20
    conv0 = torch.randn(slots, dim, W - 1 + K, generator=g).bfloat16()
    ssm0 = torch.randn(slots, Hv, D, D, generator=g) * 0.05
    T = sum(sizes)
    x = torch.randn(T, dim, generator=g).bfloat16()
    a, b = (torch.randn(T, Hv, generator=g).bfloat16() for _ in range(2))

    conv, ssm = conv0.clone(), ssm0.clone()
    ctx = HybridTreeContext(parents)
    out = tree_spec_forward(ctx, layer, _gdn_meta(sizes, idx, acc), x, b, a, conv, ssm, W,
                            vllm_gdn._unpacked_conv_weight(layer))
    assert len(ctx.records) == 1
    chain_fn = vllm_gdn._spec_forward.__wrapped__ if hasattr(vllm_gdn._spec_forward, "__wrapped__") \
        else vllm_gdn._spec_forward
    start = 0
    for n, q in enumerate(sizes):
        for node in range(q):
            path = path_to(parents[n], node)
            c, s = conv0.clone(), ssm0.clone()
            # vLLM's chain path needs q >= num_accepted: move the committed window and
            # state to offset 0 / slot 0 (same values) and run it with num_accepted = 1.
            off, slot0 = int(acc[n]) - 1, int(idx[n, 0])
            c[slot0, :, : W - 1] = conv0[slot0, :, off : off + W - 1]
            s[slot0] = ssm0[int(idx[n, off])]
            rows = [start + t for t in path]
            ref = chain_fn(layer, _gdn_meta([len(path)], idx[n : n + 1], torch.tensor([1])),
                           x[rows], b[rows], a[rows], c, s, W, W - 1 + K)
            # The two vLLM kernels round bf16 q/k/v differently (spec: fp32 running state
            # across the chain; decode: per token), so a few elements differ by ~1e-3.
            torch.testing.assert_close(out[start + node].float(), ref[-1].float(),
                                       rtol=2e-2, atol=1e-2)
            # committing this node's path writes the chain's state to block a, and the
            # committed window followed by the path's inputs where the next step reads it
            got_ssm, got_conv = ssm.clone(), conv.clone()
            dataclasses.replace(ctx.records[0], states=got_ssm, conv_buf=got_conv).commit(
                {n: path})
            last = len(path) - 1
            torch.testing.assert_close(got_ssm[idx[n, last]], s[idx[n, last]], rtol=2e-2,
                                       atol=1e-2)
            chain_in = torch.cat([conv0[slot0, :, off : off + W - 1], x[rows].T], dim=-1)
            torch.testing.assert_close(got_conv[slot0, :, last : last + W - 1],
                                       chain_in[:, -(W - 1):], rtol=0, atol=0)
        start += q
