"""One attention layer of DDTree tree verification on vLLM's CPU backend: old vs new impl.

Times ``DDTreeCPUAttentionImpl.forward`` (vLLM's causal kernel for the whole batch plus the
recomputation of the tree rows) for one layer of Qwen3-0.6B's shape (16 query heads, 8 KV heads,
head 128, bf16 by default) at a committed context of ``--context`` tokens, node budgets ``B`` and
batch sizes, next to vLLM's plain causal forward over the same rows (a DFlash-like chain of the
same width: the floor tree attention can reach) — both implementations in one run, interleaved,
because the machine is noisy. The old implementation is ``vllm_ddtree/attention/cpu.py`` at
``--old-rev`` (loaded from git as a module); the new one is the working tree's. Trees come from
``vllm_ddtree.tree.build_draft_tree`` on random per-depth distributions (``--sharpness``: larger
is more peaked, i.e. deeper and less bushy trees). Also checks the new output against the old one
and against the torch reference ``tree_attention_reference``.

    python benchmarks/cpu_tree_attention.py                       # B 16 64 256, batch 1 and 8
    python benchmarks/cpu_tree_attention.py --budgets 64 --batches 1 --reps 5
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--context", type=int, default=800)
    p.add_argument("--depth", type=int, default=15, help="drafter horizon L")
    p.add_argument("--sharpness", type=float, nargs="+", default=[1.0, 3.0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--old-rev", default="7400fda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--shape", type=int, nargs=3, default=[16, 8, 128],
                   metavar=("HEADS", "KV_HEADS", "HEAD_SIZE"),
                   help="default: Qwen3-0.6B's; the shipped trained pair's target is 4 2 64")
    return p.parse_args(argv)


def load_old(rev):
    """``vllm_ddtree/attention/cpu.py`` at ``rev`` as a module, with that revision's
    ``attention/paged.py`` (the helpers it imports may since have changed)."""
    def show(path):
        return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout

    def load(name, src):
        path = Path("/tmp") / f"{name}.py"
        path.write_text(src)
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
        spec.loader.exec_module(mod)
        return mod

    tag = "".join(c if c.isalnum() else "_" for c in rev)  # a module name
    paged = load(f"ddtree_paged_{tag}", show("vllm_ddtree/attention/paged.py"))
    src = show("vllm_ddtree/attention/cpu.py").replace(
        "from vllm_ddtree.attention.paged import", f"from {paged.__name__} import")
    return load(f"ddtree_cpu_attn_{tag}", src)


def main(argv=None):
    args = parse_args(argv)
    import torch
    import vllm.v1.attention.backends.cpu_attn as cpu_attn
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.cpu_attn import (CPUAttentionBackendImpl,
                                                    CPUAttentionMetadataBuilder, _get_attn_isa)

    from vllm_ddtree.attention import cpu as new_mod
    from vllm_ddtree.attention.common import (TreeAttentionBatch, TreeAttentionRequest,
                                              tree_attention_active)
    from vllm_ddtree.attention.paged import tree_attention_reference
    from vllm_ddtree.tree import build_draft_tree

    dtype = getattr(torch, args.dtype)
    cpu_attn.get_current_vllm_config = lambda: SimpleNamespace(
        model_config=SimpleNamespace(dtype=dtype))
    old_mod = load_old(args.old_rev)
    (H, Hkv, D), bs = args.shape, args.block_size
    isa = _get_attn_isa(dtype, bs, D)
    impl_args = (H, D, D ** -0.5, Hkv, None, None, "auto")
    impls = {"old": old_mod.DDTreeCPUAttentionImpl(*impl_args),
             "new": new_mod.DDTreeCPUAttentionImpl(*impl_args),
             "causal": CPUAttentionBackendImpl(*impl_args)}
    layer = SimpleNamespace(isa=isa, _k_scale_float=1.0, _v_scale_float=1.0, layer_name="l0")
    print(f"isa {isa}, {torch.get_num_threads()} threads, context {args.context}, dtype {args.dtype}, "
          f"old = {args.old_rev}", flush=True)
    print("| B | batch | sharpness | chains/req (max) | off-spine rows/req (max) | causal ms | old ms | "
          "new ms | old/new | new vs old: elems differing (max abs) | new vs reference max abs |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for B in args.budgets:
        for R in args.batches:
            for sharp in args.sharpness:
                g = torch.Generator().manual_seed(B * 100 + R)
                trees = [build_draft_tree(torch.log_softmax(
                    sharp * torch.randn(args.depth, 256, generator=g), -1), B) for _ in range(R)]
                n = [t.num_nodes + 1 for t in trees]
                ctx = [args.context + 7 * r for r in range(R)]
                blocks = [(c + m + bs - 1) // bs for c, m in zip(ctx, n)]
                nb = sum(blocks) + 2
                perm = torch.randperm(nb - 1, generator=g)[: sum(blocks)] + 1
                table = torch.zeros(R, max(blocks), dtype=torch.int32)
                o = 0
                for r, b in enumerate(blocks):
                    table[r, :b] = perm[o:o + b].int()
                    o += b
                kv = torch.randn(nb, Hkv, bs, 2 * D, generator=g).to(dtype)
                kc, vc = kv.view(nb, Hkv, 2 * bs, D).chunk(2, dim=2)

                def slots(r, lo, hi):
                    pos = torch.arange(lo, hi)
                    return table[r].long()[pos // bs] * bs + pos % bs

                prefix = [(torch.randn(c, Hkv, D, generator=g).to(dtype),
                           torch.randn(c, Hkv, D, generator=g).to(dtype)) for c in ctx]
                for r, (k, v) in enumerate(prefix):
                    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots(r, 0, ctx[r]), isa)
                T = sum(n)
                q = torch.randn(T, H, D, generator=g).to(dtype)
                k = torch.randn(T, Hkv, D, generator=g).to(dtype)
                v = torch.randn(T, Hkv, D, generator=g).to(dtype)
                sm = torch.cat([slots(r, c, c + m) for r, (c, m) in enumerate(zip(ctx, n))])
                builder = object.__new__(CPUAttentionMetadataBuilder)
                builder.__dict__.update(num_heads=H, num_kv_heads=Hkv, head_dim=D, dtype=dtype,
                                        window_size=-1, block_size=bs, kv_cache_dtype="auto",
                                        isa=isa, is_cross_attention=False,
                                        is_encoder_only_attention=False)
                qsl = torch.zeros(R + 1, dtype=torch.int32)
                qsl[1:] = torch.cumsum(torch.tensor(n, dtype=torch.int32), 0)
                starts = qsl.tolist()

                def metadata():
                    return builder.build(0, CommonAttentionMetadata(
                        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(),
                        seq_lens=torch.tensor([c + m for c, m in zip(ctx, n)], dtype=torch.int32),
                        num_reqs=R, num_actual_tokens=T, max_query_len=max(n),
                        max_seq_len=max(c + m for c, m in zip(ctx, n)), block_table_tensor=table,
                        slot_mapping=sm, causal=True))

                times = {name: [] for name in impls}
                outs = {}
                for rep in range(args.reps + 1):
                    for name, impl in impls.items():
                        cache = kv.clone()
                        md = metadata()  # a fresh metadata object per forward, as in a step
                        batch = TreeAttentionBatch(
                            requests=[TreeAttentionRequest(r, starts[r], n[r], ctx[r],
                                                           trees[r].ancestor_mask)
                                      for r in range(R)],
                            tree_rows=torch.arange(T))
                        out = torch.empty_like(q)
                        impl.do_kv_cache_update(layer, k, v, cache, sm)
                        t0 = time.perf_counter()
                        with tree_attention_active(batch if name != "causal" else None):
                            impl.forward(layer, q, k, v, cache, md, out)
                        dt = time.perf_counter() - t0
                        if rep:
                            times[name].append(dt)
                        outs[name] = out
                        if name != "causal":
                            assert torch.equal(cache, impls_cache_ref(impls, layer, k, v, kv, sm)), \
                                f"{name}: KV cache not restored"
                med = {name: 1e3 * statistics.median(t) for name, t in times.items()}
                diff = outs["new"] != outs["old"]
                ndiff = int(diff.sum())
                maxabs = float((outs["new"].float() - outs["old"].float()).abs().max())
                ref_err = 0.0
                for r in range(R):
                    rows = slice(starts[r], starts[r] + n[r])
                    ref = tree_attention_reference(
                        q[rows], torch.cat([prefix[r][0], k[rows]]), torch.cat([prefix[r][1], v[rows]]),
                        ctx[r], trees[r].ancestor_mask, D ** -0.5)
                    ref_err = max(ref_err, float((ref.float() - outs["new"][rows].float()).abs().max()))
                chains = max(len(old_mod.tree_chains(t.ancestor_mask)) for t in trees)
                offs = max(int((t.depths != torch.arange(t.num_nodes + 1)).sum()) for t in trees)
                print(f"| {B} | {R} | {sharp:g} | {chains} | {offs} | {med['causal']:.1f} | "
                      f"{med['old']:.1f} | {med['new']:.1f} | {med['old'] / med['new']:.1f}× | "
                      f"{ndiff} of {diff.numel()} ({maxabs:.2g}) | {ref_err:.2g} |", flush=True)
    return 0


_CACHE_REF = {}


def impls_cache_ref(impls, layer, k, v, kv, sm):
    """The KV cache after vLLM's own write of this step's K/V (what a tree forward must leave)."""
    key = (id(kv), id(k))
    if key not in _CACHE_REF:
        _CACHE_REF.clear()
        cache = kv.clone()
        impls["causal"].do_kv_cache_update(layer, k, v, cache, sm)
        _CACHE_REF[key] = cache
    return _CACHE_REF[key]


if __name__ == "__main__":
    sys.exit(main())
