"""GPU check and micro-benchmark of the Triton tree-attention kernel.

Prepared for a CUDA machine with torch + triton and *no* vLLM: it imports only torch and
``vllm_ddtree.attention.triton_tree`` (which imports no vLLM; checked at start-up). Run from the
repository root::

    python benchmarks/gpu_tree_attention.py                     # GPU: checks + benchmark table
    TRITON_INTERPRET=1 python benchmarks/gpu_tree_attention.py --smoke   # CPU: tiny, ~1 min

1. Correctness: random mixed batches (prefill chunk, decode rows, trees of 1..33+ rows, a tree
   after a chunk, a tree at context 0, a padding request) against the torch reference
   ``tree_attention_paged_reference``, over fp32/fp16/bf16, head sizes 64/128 (32 in smoke),
   block sizes 16/32/64, GQA groups 1/3/4; a chain-shaped tree must equal causal attention; the
   stacked ``[2, nb, bs, Hkv, D]`` cache must give the same result; KV compaction on both layouts.
2. Benchmark (bf16, 32 query heads / 8 KV heads / head size 128, block size 16): per request a
   tree of B + 1 rows (random tree) versus a DFlash-style chain of L + 1 = 16 causal rows, batch
   1 and 8, context 1k and 8k, B in {16, 64, 256}. Prints a markdown table of ms per call
   (CUDA events, median over repeats) and the ratio tree / chain. ``chain-as-tree`` is the same
   16 rows through the tree path (a lower-triangular mask): the cost of the bitmask itself.
   Launch parameters are the engine's own (``choose_tree_kernel_config`` for the device's shared
   memory, printed per B) unless ``--block-m`` / ``--tile-n`` / ``--num-warps`` /
   ``--num-stages`` override them.

Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from gpu_timing import select_device, time_call  # noqa: E402  (benchmarks/, the script's folder)

from vllm_ddtree.attention.triton_tree import (  # noqa: E402
    HAS_TRITON,
    build_tree_mask_buffers,
    choose_tree_kernel_config,
    compact_kv_nhd,
    compact_kv_stacked,
    device_shared_memory_limit,
    tree_attention_paged,
    tree_attention_paged_reference,
)

assert not any(m == "vllm" or m.startswith("vllm.") for m in sys.modules), "vLLM was imported"


# --------------------------------------------------------------------------- cases


def random_tree_mask(m: int, gen: torch.Generator) -> torch.Tensor:
    """Ancestor-or-self mask of a random ``m``-node tree in topological order."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, m)]
    mask = torch.zeros(m, m, dtype=torch.bool)
    for i in range(m):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def make_case(q_lens, seq_lens, tree_rows, *, num_heads, num_kv_heads, head_size, block_size,
              dtype, device, seed=0, chain=False, stacked=False):
    """Random paged cache + metadata. ``tree_rows[r]``: rows of request r's tree (0 = none)."""
    gen = torch.Generator().manual_seed(seed)
    num_reqs = len(q_lens)
    max_blocks = max(1, max(-(-s // block_size) for s in seq_lens))
    num_blocks = num_reqs * max_blocks + 1
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    kv = torch.randn((2,) + shape, generator=gen).to(dtype).to(device)
    perm = torch.randperm(num_blocks, generator=gen)[: num_reqs * max_blocks]
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    masks = []
    for m in tree_rows:
        if not m:
            masks.append(None)
        elif chain:
            masks.append(torch.ones(m, m, dtype=torch.bool).tril())
        else:
            masks.append(random_tree_mask(m, gen))
    buffers = build_tree_mask_buffers(masks, q_lens, device=device)
    query = torch.randn(qsl[-1], num_heads, head_size, generator=gen).to(dtype).to(device)
    return dict(
        query=query,
        kv=kv,
        key_cache=kv[0],
        value_cache=kv[1],
        block_table=perm.view(num_reqs, max_blocks).to(torch.int32).to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        buffers=buffers,
        scale=head_size**-0.5,
        max_query_len=max(q_lens),
    )


def run_kernel(c, **kw):
    b = c["buffers"]
    return tree_attention_paged(
        c["query"], c["key_cache"], c["value_cache"], c["block_table"], c["seq_lens"],
        c["query_start_loc"], b.tree_start, b.tree_mask, b.tree_mask_offsets, c["scale"],
        max_query_len=c["max_query_len"], **kw,
    )


def run_reference(c):
    b = c["buffers"]
    return tree_attention_paged_reference(
        c["query"], c["key_cache"], c["value_cache"], c["block_table"], c["seq_lens"],
        c["query_start_loc"], b.tree_start, b.tree_mask, b.tree_mask_offsets, c["scale"],
    )


# --------------------------------------------------------------------------- checks

MIXED = dict(
    q_lens=[20, 1, 5, 1, 12, 33, 9, 0, 6],
    seq_lens=[20, 37, 50, 5, 12, 70, 30, 0, 41],
    tree_rows=[0, 0, 5, 1, 12, 33, 6, 0, 0],
)
BIG = dict(  # GPU only: a 257-row tree over a long context, and a long prefill
    q_lens=[257, 300, 1, 17],
    seq_lens=[3000, 300, 4000, 1500],
    tree_rows=[257, 0, 0, 17],
)
TOL = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 4e-2}


def correctness(device: str, smoke: bool) -> list[str]:
    failures: list[str] = []

    def check(name, got, want, tol):
        diff = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
        ok = diff <= tol and not bool(got.isnan().any())
        print(f"  {'ok  ' if ok else 'FAIL'} {name}: max abs diff {diff:.2e} (tol {tol:.0e})")
        if not ok:
            failures.append(name)

    if smoke:
        configs = [(4, 2, 32, 16, torch.float32), (6, 2, 32, 32, torch.bfloat16)]
        shapes = [("mixed", MIXED)]
    else:
        configs = [
            (h, hkv, d, bs, dt)
            for dt in (torch.float32, torch.float16, torch.bfloat16)
            for (h, hkv, d) in ((8, 2, 128), (12, 4, 64), (4, 4, 64))
            for bs in (16, 32, 64)
        ]
        shapes = [("mixed", MIXED), ("big", BIG)]
    print("correctness vs torch reference:")
    for h, hkv, d, bs, dt in configs:
        for sname, shape in shapes:
            c = make_case(**shape, num_heads=h, num_kv_heads=hkv, head_size=d, block_size=bs,
                          dtype=dt, device=device, seed=h + d + bs)
            name = f"{sname} H={h} Hkv={hkv} D={d} bs={bs} {str(dt)[6:]}"
            check(name, run_kernel(c, check_metadata=True), run_reference(c), TOL[dt])

    d = 32 if smoke else 128
    kw = dict(q_lens=[16, 1, 9], seq_lens=[400, 21, 9], num_heads=8, num_kv_heads=2,
              head_size=d, block_size=16, dtype=torch.float32, device=device, seed=1)
    chain = make_case(**kw, tree_rows=[16, 0, 9], chain=True)
    causal = make_case(**kw, tree_rows=[0, 0, 0])
    check("chain tree == causal", run_kernel(chain), run_reference(causal), 1e-5)

    c = make_case(**MIXED, num_heads=8, num_kv_heads=2, head_size=d, block_size=16,
                  dtype=torch.bfloat16, device=device, seed=7)
    want = run_kernel(c)
    tr = torch.stack([c["key_cache"], c["value_cache"]], dim=1).contiguous()  # [nb, 2, bs, ...]
    c2 = dict(c, key_cache=tr[:, 0], value_cache=tr[:, 1])
    check("[nb, 2, bs, Hkv, D] halves == stacked [2, nb, ...]", run_kernel(c2), want, 0.0)

    # KV compaction: accepted nodes 0, 2, 5 of request 2's tree move to the root's next slots.
    bs = c["key_cache"].shape[1]
    root = MIXED["seq_lens"][2] - MIXED["tree_rows"][2]
    bt = c["block_table"][2].tolist()
    slot = lambda p: bt[p // bs] * bs + p % bs  # noqa: E731
    src = torch.tensor([slot(root + i) for i in (0, 2, 4)], device=device)
    dst = torch.tensor([slot(root + k) for k in range(3)], device=device)
    flat = c["kv"].flatten(1, 2)
    want_kv = flat.clone()
    want_kv[:, dst] = flat[:, src]
    kv = c["kv"].clone()
    compact_kv_stacked(kv, src, dst)
    ok = torch.equal(kv.flatten(1, 2), want_kv) and not torch.equal(flat, want_kv)
    kv = c["kv"].clone()
    compact_kv_nhd(kv[0], kv[1], src.int(), dst.int())
    ok = ok and torch.equal(kv.flatten(1, 2), want_kv)
    print(f"  {'ok  ' if ok else 'FAIL'} KV compaction (stacked and NHD halves)")
    if not ok:
        failures.append("compaction")
    return failures


# --------------------------------------------------------------------------- benchmark


def benchmark(device: str, smoke: bool, args) -> str:
    if smoke:
        h, hkv, d, bs, dt = 4, 2, 32, 16, torch.float32
        batches, contexts, budgets, chain_rows = [1, 2], [40], [4], 5
        iters, repeats = 1, 1
    else:
        h, hkv, d, bs, dt = 32, 8, 128, 16, torch.bfloat16
        batches, contexts, budgets, chain_rows = [1, 8], [1024, 8192], [16, 64, 256], 16
        iters, repeats = args.iters, args.repeats
    kw = dict(block_m=args.block_m, tile_n=args.tile_n, num_warps=args.num_warps,
              num_stages=args.num_stages)
    kw = {k: v for k, v in kw.items() if v is not None}
    lines = [
        f"H={h} Hkv={hkv} D={d} block_size={bs} {str(dt)[6:]}, chain = {chain_rows} causal rows"
        f" (L + 1), tree = B + 1 rows; ms per call (median of {repeats} x {iters})",
        "",
        "| batch | context | B | tree ms | chain ms | chain-as-tree ms | tree / chain |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    limit = device_shared_memory_limit(device)
    for i, budget in enumerate(budgets):
        c = choose_tree_kernel_config(dt, d, h // hkv, budget + 1, limit)
        lines.insert(1 + i, f"B={budget}: block_m {c.block_m}, tile_n {c.tile_n}, "
                            f"{c.num_warps} warps, {c.num_stages} stages (the engine's choice; "
                            f"shared memory per block {limit or 'unlimited (interpreter)'})")
    for batch in batches:
        for ctx in contexts:
            common = dict(num_heads=h, num_kv_heads=hkv, head_size=d, block_size=bs, dtype=dt,
                          device=device)
            chain = make_case([chain_rows] * batch, [ctx + chain_rows] * batch, [0] * batch,
                              seed=3, **common)
            chain_tree = make_case([chain_rows] * batch, [ctx + chain_rows] * batch,
                                   [chain_rows] * batch, chain=True, seed=3, **common)
            t_chain = time_call(lambda: run_kernel(chain, **kw), device, iters, repeats)
            t_ct = time_call(lambda: run_kernel(chain_tree, **kw), device, iters, repeats)
            for budget in budgets:
                m = budget + 1
                tree = make_case([m] * batch, [ctx + m] * batch, [m] * batch, seed=4, **common)
                t_tree = time_call(lambda: run_kernel(tree, **kw), device, iters, repeats)
                lines.append(
                    f"| {batch} | {ctx} | {budget} | {t_tree:.3f} | {t_chain:.3f} | {t_ct:.3f} "
                    f"| {t_tree / t_chain:.2f} |"
                )
                del tree
            del chain, chain_tree
            if device == "cuda":
                torch.cuda.empty_cache()
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes (CPU interpreter)")
    p.add_argument("--skip-checks", action="store_true")
    p.add_argument("--skip-bench", action="store_true")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--block-m", type=int, default=None)
    p.add_argument("--tile-n", type=int, default=None)
    p.add_argument("--num-warps", type=int, default=None)
    p.add_argument("--num-stages", type=int, default=None)
    p.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = p.parse_args(argv)

    if not HAS_TRITON:
        print("triton is not installed", file=sys.stderr)
        return 2
    device = select_device()
    if device is None:
        return 2
    import triton

    print(f"torch {torch.__version__}, triton {triton.__version__}")
    if device == "cpu" and not args.smoke:
        print("note: full sizes under the interpreter take very long; use --smoke")

    failures = [] if args.skip_checks else correctness(device, args.smoke)
    if not args.skip_bench:
        table = benchmark(device, args.smoke, args)
        print()
        print(table)
        if args.out is not None:
            args.out.write_text(table + "\n")
    if failures:
        print(f"\n{len(failures)} check(s) FAILED: {failures}")
        return 1
    print("\nall checks passed" if not args.skip_checks else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
