"""Per-node check of the CUDA GatedDeltaNet oracle through vLLM's Triton kernels (interpreted).

Run as a script (a fresh process: Triton's interpreter must be chosen before Triton loads):
``python tests/support/gdn_cuda_check.py`` prints one JSON object of maximum errors. For random
draft trees of several requests (slots shuffled, committed slot at ``num_accepted - 1``), the
plugin's :func:`vllm_ddtree.hybrid.gdn_cuda.tree_conv_update` and
:func:`~vllm_ddtree.hybrid.gdn_cuda.tree_gated_delta_update` run through vLLM's Triton
``causal_conv1d_update`` and ``fused_sigmoid_gating_delta_rule_update``; every node's conv
output and core output, and the state and conv window that committing its path writes (a replay
through the same kernels), are compared with its root-to-node path run as a chain through the
fp32 references of :mod:`vllm_ddtree.hybrid.oracle`.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> dict:
    from tests.support import v2_cpu

    v2_cpu.install()
    from tests.support import cuda_recurrent

    cuda_recurrent._bool_masks()
    import torch
    import torch.nn.functional as F
    from vllm.third_party.flash_linear_attention.ops import fused_sigmoid_gating_delta_rule_update

    from vllm_ddtree.hybrid.context import HybridTreeContext
    from vllm_ddtree.hybrid.gdn_cuda import tree_conv_update, tree_gated_delta_update
    from vllm_ddtree.hybrid.oracle import gated_delta_step_reference, tree_causal_conv

    conv_update = cuda_recurrent.triton_conv_ops()["causal_conv1d_update"]
    g = torch.Generator().manual_seed(0)
    H, HV, K, V, W = 2, 4, 16, 16, 4
    dim = 2 * H * K + HV * V
    trees = [  # parents (root -1) of each request's tree; a chain; a tree with 9 nodes
        torch.tensor([-1, 0, 0, 1, 1, 2, 3, 3, 6]),
        torch.tensor([-1, 0, 1, 2]),
        torch.tensor([-1, 0, 0, 0, 1, 4, 5]),
    ]
    Kslots = 5  # L + 1 state blocks: fewer than the 9-node tree's nodes, as DDTree asks vLLM
    num_slots = 1 + len(trees) * Kslots
    perm = (torch.randperm(num_slots - 1, generator=g) + 1).view(len(trees), Kslots)
    accepted = torch.tensor([2, 1, 3], dtype=torch.int32)
    lens = [t.numel() for t in trees]
    T = sum(lens)
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    md = SimpleNamespace(num_spec_decodes=len(trees), spec_query_start_loc=qsl,
                         spec_sequence_masks=None, spec_state_indices_tensor=perm.to(torch.int32),
                         num_accepted_tokens=accepted)
    ctx = HybridTreeContext({n: t for n, t in enumerate(trees) if n != 1})
    ctx.gdn_call = (None, md)

    x = torch.randn(T, dim, generator=g)
    x_in = x.clone()  # the Triton conv writes its outputs into x, as in vLLM
    weight, bias = torch.randn(dim, W, generator=g) * 0.5, torch.randn(dim, generator=g)
    conv_state = torch.randn(num_slots, dim, W - 1 + 8, generator=g)
    committed_win = [conv_state[perm[n, 0], :, int(accepted[n]) - 1: int(accepted[n]) - 1 + W - 1]
                     .clone() for n in range(len(trees))]
    conv_out = tree_conv_update(ctx, conv_update, x, conv_state, weight, bias, "silu")

    q = torch.randn(1, T, H, K, generator=g)
    k = torch.randn(1, T, H, K, generator=g)
    v = torch.randn(1, T, HV, V, generator=g)
    a, b = torch.randn(T, HV, generator=g), torch.randn(T, HV, generator=g)
    A_log, dt_bias = torch.randn(HV, generator=g) * 0.5, torch.randn(HV, generator=g)
    S = torch.randn(num_slots, HV, V, K, generator=g) * 0.1
    S0 = S.clone()
    o, _ = tree_gated_delta_update(
        ctx, fused_sigmoid_gating_delta_rule_update, A_log=A_log, a=a, b=b, dt_bias=dt_bias,
        q=q, k=k, v=v, initial_state=S, use_qk_l2norm_in_kernel=True)

    assert torch.equal(S, S0), "the forward wrote a state block"
    err = {"conv": 0.0, "out": 0.0, "state": 0.0, "window": 0.0, "nodes": 0}
    start = 0
    for n, parents in enumerate(trees):
        for t in range(parents.numel()):
            path, cur = [], t
            while cur >= 0:
                path.append(cur)
                cur = int(parents[cur])
            path.reverse()
            # conv: the node's window is its ancestors' inputs after the committed window
            seq = torch.cat([committed_win[n].T, x_in[[start + p for p in path]]])
            win = seq[-W:-1].T.unsqueeze(0)
            ref_conv = tree_causal_conv(x_in[start + t: start + t + 1], win, weight, bias, "silu")
            err["conv"] = max(err["conv"], float((conv_out[start + t] - ref_conv[0]).abs().max()))
            # recurrence along the path, from the committed slot
            st = S0[int(perm[n, int(accepted[n]) - 1])].transpose(-1, -2).unsqueeze(0)
            for p in path:
                i = start + p
                rep = HV // H
                st, ref_o = gated_delta_step_reference(
                    st, q[0, i].repeat_interleave(rep, 0)[None], k[0, i].repeat_interleave(rep, 0)[None],
                    v[0, i][None], a[i][None], b[i][None], A_log, dt_bias)
            err["out"] = max(err["out"], float((o[0, start + t] - ref_o[0]).abs().max()))
            # the commit of this node's path replays it into block a (the forward writes no
            # block); the committed conv window of the next step follows the path
            S_commit, conv_commit = S.clone(), conv_state.clone()
            for rec in ctx.records:
                dataclasses.replace(rec, states=S_commit if rec.states is not None else None,
                                    conv_buf=conv_commit if rec.conv_buf is not None else None,
                                    ).commit({n: path})
            got_state = S_commit[int(perm[n, len(path) - 1])].transpose(-1, -2)
            err["state"] = max(err["state"], float((got_state - st[0]).abs().max()))
            got_win = conv_commit[perm[n, 0], :, len(path) - 1 : len(path) - 1 + W - 1]
            err["window"] = max(err["window"], float((got_win - seq[-(W - 1):].T).abs().max()))
            err["nodes"] += 1
        start += parents.numel()
    del F
    return err


if __name__ == "__main__":
    print(json.dumps(main()))
