"""How far CPU tree rows round from vLLM's own decode rows, one call per layer vs chain by chain.

For every tree row of a few random draft trees (Qwen3-0.6B's attention heads: 16 query / 8 KV
heads of 128, blocks of 128, bf16 by default), the row as a target-only decode would compute it
is vLLM's CPU kernel run as a one-token query over the row's context and ancestor path, laid out
contiguously (the "per-node kernel" of ``tests/test_tree_attention_cpu.py``). The plugin's rows
are compared with it element by element, from both of ``DDTreeCPUAttentionImpl``'s paths: one
float32 call per layer (``ONE_CALL_ISAS``) and chain by chain through vLLM's kernel (vLLM's own
chain-verification rounding), next to the float32 torch reference rounded once. Prints the share
of differing elements, the rows that have one, and the largest difference relative to its row's
largest element, in units of the dtype's epsilon (1: one rounding step at the row's scale).

    python benchmarks/tree_row_rounding.py             # 6 scenarios, ~1 min on 2 cores
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", type=int, default=6)
    p.add_argument("--dtype", default="bfloat16")
    return p.parse_args(argv)


def random_tree(rng, n, depth=15):
    """Parents of an ``n``-node tree, each node under a random earlier node of depth < ``depth``."""
    parents, depths = [-1], [0]
    for i in range(1, n):
        while True:
            p = rng.randrange(i)
            if depths[p] < depth:
                break
        parents.append(p)
        depths.append(depths[p] + 1)
    return parents


def main(argv=None):
    args = parse_args(argv)
    import torch
    from vllm.v1.attention.backends import cpu_attn

    import vllm_ddtree.attention.cpu as cpu_backend
    from tests import test_tree_attention_cpu as t
    from vllm_ddtree.attention.common import (
        TreeAttentionBatch,
        TreeAttentionRequest,
        tree_attention_active,
    )
    from vllm_ddtree.attention.paged import tree_attention_reference

    dtype = getattr(torch, args.dtype)
    cpu_attn.get_current_vllm_config = lambda: SimpleNamespace(  # as the tests' fixture does
        model_config=SimpleNamespace(dtype=dtype))
    heads, kv_heads, head_size, block_size = 16, 8, 128, 128
    eps = torch.finfo(dtype).eps
    rng = random.Random(0)
    paths = {"one call per layer": cpu_backend.ONE_CALL_ISAS, "chain by chain": ()}
    totals = {name: [0, 0, 0, 0, 0.0] for name in [*paths, "float32 reference"]}
    for seed in range(args.scenarios):
        trees = [random_tree(rng, 64), random_tree(rng, 16)]
        contexts = [800 + 37 * seed, 300]
        sizes = [len(p) for p in trees]
        sc = t.make_scenario(contexts, sizes, num_heads=heads, num_kv_heads=kv_heads,
                             head_size=head_size, block_size=block_size, dtype=dtype, seed=seed)
        requests = [TreeAttentionRequest(batch_index=r, query_start=sc.query_start[r],
                                         num_rows=sizes[r], context_len=contexts[r],
                                         ancestor_mask=t.parents_to_mask(p))
                    for r, p in enumerate(trees)]
        rows = torch.cat([torch.arange(q.query_start, q.query_start + q.num_rows)
                          for q in requests])
        ours, vllms = t.make_impls(heads, head_size, kv_heads)
        outs = {}
        min_rows = cpu_backend.LOW_PRECISION_ONE_CALL_MIN_ROWS
        cpu_backend.LOW_PRECISION_ONE_CALL_MIN_ROWS = 0  # the path is chosen here, not by size
        for name, isas in paths.items():
            cpu_backend.ONE_CALL_ISAS = isas
            with tree_attention_active(TreeAttentionBatch(requests=requests, tree_rows=rows)):
                outs[name] = t.run_impl(ours, sc, sc.kv_cache.clone())
        cpu_backend.ONE_CALL_ISAS = paths["one call per layer"]
        cpu_backend.LOW_PRECISION_ONE_CALL_MIN_ROWS = min_rows
        decode = t._per_node_kernel(sc, vllms, requests, head_size, block_size)
        for req in requests:
            b, lo = req.batch_index, req.query_start
            span = slice(lo, lo + req.num_rows)
            outs_ref = tree_attention_reference(
                sc.query[span], torch.cat([sc.prefix_k[b], sc.key[span]]),
                torch.cat([sc.prefix_v[b], sc.value[span]]), req.context_len,
                req.ancestor_mask, head_size ** -0.5)
            for i in range(req.num_rows):
                want = decode[lo + i].float()
                got_by = {name: outs[name][lo + i].float() for name in paths}
                got_by["float32 reference"] = outs_ref[i].float()
                for name, got in got_by.items():
                    diff = got != want
                    ulps = (got - want).abs().max() / (eps * want.abs().max())
                    tot = totals[name]
                    tot[0] += int(diff.sum())
                    tot[1] += want.numel()
                    tot[2] += int(diff.any())
                    tot[3] += 1
                    tot[4] = max(tot[4], float(ulps))
    print(f"{args.scenarios} scenarios ({args.dtype}, trees of 64 and 16 nodes, contexts "
          f"800-{800 + 37 * (args.scenarios - 1)} and 300), against vLLM's one-token decode rows")
    print("| tree rows | elements differing | share | rows with one | max difference / row max (eps) |")
    print("|---|---|---|---|---|")
    for name, (d, n, rd, rn, u) in totals.items():
        print(f"| {name} | {d} of {n} | {d / n:.1e} | {rd} of {rn} | {u:.2f} |")


if __name__ == "__main__":
    main()
