"""``"ddtree_budget": "auto"`` against fixed node budgets, DFlash and target-only, one run.

The shipped trained pair (``models/``), greedy, fp32, eager, V1 runner, held-out prompts, at
batch 1 (prompts one after another) and batch 8 (all prompts in one ``generate``).
Interleaved: every configuration's engine (target-only, vLLM's DFlash, DDTree at each fixed B,
DDTree ``auto``) lives in this process through the whole run, and each prompt group (one prompt at batch 1, all eight at batch 8) runs
on every engine, in a shuffled order, before the next group, so slow spells of this noisy machine
hit every configuration alike; the table reports the median over rounds. Every output is checked
against target-only (greedy equality). ``auto`` learns online from the engine's own step times,
per batch size: every engine first generates one pass over the prompts at each measured batch
size (warm-up, not measured; as a server that has served such loads).

Writes ``docs/benchmark_auto.md`` (table, ratios, command), ``docs/benchmark_auto.png`` (tokens/s
against B, ``auto`` and DFlash as lines) and ``docs/benchmark_auto.json`` (raw numbers).

    python benchmarks/auto_budget.py               # ~20 min on 2 cores
    python benchmarks/auto_budget.py --rounds 1 --budgets 4 32 --num-prompts 2 --max-tokens 16
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from e2e import SpecCounter, step_metrics, wrap_steps  # noqa: E402  (also puts ROOT on sys.path)

BUDGETS = (4, 8, 16, 32, 64, 128, 256)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budgets", type=int, nargs="+", default=list(BUDGETS))
    p.add_argument("--max-budget", type=int, default=64, help="ddtree_max_budget of 'auto'")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--out-dir", default=str(ROOT / "docs"))
    p.add_argument("--report-from", default=None,
                   help="JSON written by an earlier run: rewrite its report without measuring")
    return p.parse_args(argv)


def configs(args, drafter: str) -> list[tuple[str, dict | None]]:
    out = [("AR", None),
           ("DFlash", {"method": "dflash", "model": drafter, "num_speculative_tokens": 15})]
    out += [(f"B={b}", {"method": "ddtree", "model": drafter, "ddtree_budget": b})
            for b in args.budgets]
    out.append(("auto", {"method": "ddtree", "model": drafter, "ddtree_budget": "auto",
                         "ddtree_max_budget": args.max_budget}))
    return out


def _auto_state(worker):
    """Run in the worker (``collective_rpc``): the controller's running totals."""
    ctl = getattr(worker.model_runner.drafter, "controller", None)
    if ctl is None:
        return None
    s = ctl.stats
    return {"trees": s.trees, "nodes": s.budget_sum, "fallback_steps": s.chain_fallback_steps,
            "steps": s.steps}


def run(args) -> list[dict]:
    from vllm import SamplingParams

    from tests.support import trained
    from tests.support.models import make_llm

    target, drafter = (str(p) for p in trained.require())
    prompts = trained.heldout_prompts(args.num_prompts)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    engines = []
    for name, spec in configs(args, drafter):
        t0 = time.perf_counter()
        llm = make_llm(target, **({"speculative_config": spec} if spec else {}))
        steps, counter = wrap_steps(llm), SpecCounter(llm)
        # Warm-up, the same for every configuration: one pass over the prompts at each batch
        # size (auto learns its step costs per batch size and its calibration here, as a
        # long-running server has; every configuration meets its step shapes once).
        for batch in args.batches:
            for i in range(0, len(prompts), batch):
                llm.generate(prompts[i:i + batch], params, use_tqdm=False)
        engines.append((name, spec, llm, steps, counter))
        print(f"{name:>7} ready ({time.perf_counter() - t0:.0f}s)", flush=True)
    rows, ref = [], {}
    for rnd in range(args.rounds):
        for batch in args.batches:
            acc = {}
            for name, spec, llm, steps, counter in engines:
                steps.clear()
                acc[name] = {"before": counter.counts(), "outs": [], "seconds": 0.0,
                             "auto": llm.collective_rpc(_auto_state)[0] if name == "auto"
                             else None}
            # Every prompt group runs on every engine before the next group, in a shuffled
            # order: a slow spell of the machine hits all configurations alike.
            for g, i in enumerate(range(0, len(prompts), batch)):
                order = list(engines)
                random.Random(f"{rnd}/{batch}/{g}").shuffle(order)
                for name, spec, llm, steps, counter in order:
                    t0 = time.perf_counter()
                    acc[name]["outs"] += llm.generate(prompts[i:i + batch], params,
                                                      use_tqdm=False)
                    acc[name]["seconds"] += time.perf_counter() - t0
            for name, spec, llm, steps, counter in engines:
                a = acc[name]
                ids, m = step_metrics(a["before"], counter.counts(), a["outs"], a["seconds"],
                                      steps)
                if spec is None:
                    ref.setdefault(batch, ids)
                m.update(config=name, batch=batch, round=rnd, identical_to_ar=ids == ref[batch])
                if a["auto"] is not None:
                    after = llm.collective_rpc(_auto_state)[0]
                    trees = after["trees"] - a["auto"]["trees"]
                    m["auto_mean_budget"] = (after["nodes"] - a["auto"]["nodes"]) / max(trees, 1)
                    m["auto_fallback_steps"] = (after["fallback_steps"]
                                                - a["auto"]["fallback_steps"])
                rows.append(m)
                print(f"[round {rnd}] {name:>7} batch {batch}: {m['tok_s']:7.1f} tok/s  "
                      f"tau {m['tau']:.2f}  {m['ms_per_step']:.1f} ms/step"
                      + (f"  mean B {m['auto_mean_budget']:.1f}" if a["auto"] is not None
                         else "")
                      + f"  identical {m['identical_to_ar']}", flush=True)
    return rows


def summarize(args, rows: list[dict]) -> dict:
    """Median tokens/s (and τ, ms/step) per configuration and batch, and the ratios."""
    names = [n for n, _ in configs(args, "")]
    table = {}
    for batch in args.batches:
        for name in names:
            runs = [r for r in rows if r["config"] == name and r["batch"] == batch]
            if not runs:
                continue
            med = {k: statistics.median(r[k] for r in runs)
                   for k in ("tok_s", "tau", "ms_per_step")}
            med["identical"] = all(r["identical_to_ar"] for r in runs)
            if name == "auto":
                med["mean_budget"] = statistics.median(r["auto_mean_budget"] for r in runs)
                med["fallback_steps"] = sum(r["auto_fallback_steps"] for r in runs)
            table[(name, batch)] = med
    ratios = {}
    for batch in args.batches:
        fixed = {n: table[(n, batch)]["tok_s"] for n in names if n.startswith("B=")}
        best = max(fixed, key=fixed.get)
        auto = table[("auto", batch)]["tok_s"]
        ratios[batch] = {"best_fixed": best, "auto_vs_best": auto / fixed[best],
                         "auto_vs_dflash": auto / table[("DFlash", batch)]["tok_s"],
                         "auto_vs_ar": auto / table[("AR", batch)]["tok_s"],
                         "auto_vs_best_paired": _paired(rows, batch, "auto", best),
                         "auto_vs_dflash_paired": _paired(rows, batch, "auto", "DFlash")}
    return {"table": table, "ratios": ratios}


def _paired(rows: list[dict], batch: int, a: str, b: str) -> float:
    """Median over rounds of ``a``'s tokens/s over ``b``'s in the same round. Both ran the same
    prompt groups side by side, so a slow spell of the machine cancels out of each round's
    ratio; the ratio of medians to the best of seven fixed budgets is biased upward by the
    round-to-round noise (the largest of seven noisy medians)."""
    by = {(r["config"], r["round"]): r["tok_s"] for r in rows if r["batch"] == batch}
    return statistics.median(by[(a, k)] / by[(b, k)] for (n, k) in by if n == a and (b, k) in by)


def report(args, rows, summary, elapsed) -> None:
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = [n for n, _ in configs(args, "")]
    lines = [
        "# `ddtree_budget: \"auto\"` against fixed budgets", "",
        "Generated by `python benchmarks/auto_budget.py` (shipped trained pair, greedy, fp32, "
        f"eager, V1 runner, {args.num_prompts} held-out prompts × {args.max_tokens} tokens, "
        f"{args.rounds} interleaved rounds, median; `auto` with `ddtree_max_budget`="
        f"{args.max_budget}). Machine: {platform.processor() or platform.machine()}, "
        f"run took {elapsed / 60:.0f} min.", "",
        "| config | " + " | ".join(f"batch {b}: tok/s | τ | ms/step" for b in args.batches)
        + " | = target-only |",
        "|---|" + "---|---|---|" * len(args.batches) + "---|",
    ]
    for name in names:
        cells, same = [], True
        for b in args.batches:
            m = summary["table"][(name, b)]
            extra = (f" (mean B {m['mean_budget']:.1f})" if name == "auto" else "")
            cells.append(f"{m['tok_s']:.0f}{extra} | {m['tau']:.2f} | {m['ms_per_step']:.1f}")
            same &= m["identical"]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {'yes' if same else '**no**'} |")
    lines += ["", "| batch | best fixed B | auto / best fixed | auto / DFlash | auto / target-only "
              "| paired: auto / best fixed | paired: auto / DFlash |",
              "|---|---|---|---|---|---|---|"]
    for b, r in summary["ratios"].items():
        lines.append(f"| {b} | {r['best_fixed']} | {r['auto_vs_best']:.3f} | "
                     f"{r['auto_vs_dflash']:.3f} | {r['auto_vs_ar']:.2f} | "
                     f"{r['auto_vs_best_paired']:.3f} | {r['auto_vs_dflash_paired']:.3f} |")
    lines += ["", "Ratios are of the medians over rounds; *paired*: the median over rounds of "
              "each round's ratio (both engines ran the same prompt groups side by side in it)."]
    lines += ["", "![tokens/s against B, auto, DFlash and target-only](benchmark_auto.png)", "",
              "Reading: [benchmarks.md](benchmarks.md)."]
    (out / "benchmark_auto.md").write_text("\n".join(lines) + "\n")
    (out / "benchmark_auto.json").write_text(json.dumps({
        "args": vars(args), "rows": rows, "elapsed_s": elapsed,
        "summary": {"table": {f"{n}|{b}": v for (n, b), v in summary["table"].items()},
                    "ratios": summary["ratios"]}}, indent=1))
    _plot(out / "benchmark_auto.png", args, summary)
    print("\n".join(lines))


def _plot(path: Path, args, summary) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, axes = plt.subplots(1, len(args.batches), figsize=(5 * len(args.batches), 3.6))
    for ax, b in zip(axes if len(args.batches) > 1 else [axes], args.batches):
        t = summary["table"]
        ax.plot(args.budgets, [t[(f"B={x}", b)]["tok_s"] for x in args.budgets], "o-",
                label="DDTree fixed B")
        for name, style in (("auto", "C1-"), ("DFlash", "C2--"), ("AR", "C3:")):
            ax.axhline(t[(name, b)]["tok_s"], color=style[:2], linestyle=style[2:],
                       label="DDTree auto" if name == "auto" else name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("node budget B")
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"batch {b}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    args = parse_args(argv)
    from tests.support.models import apply_cpu_test_env

    apply_cpu_test_env()  # in-process engine, 1 GiB KV cache
    t0 = time.time()
    if args.report_from:
        saved = json.loads(Path(args.report_from).read_text())
        rows, elapsed = saved["rows"], saved.get("elapsed_s", 0.0)
        for key in ("budgets", "max_budget", "rounds", "num_prompts", "max_tokens", "batches"):
            setattr(args, key, saved["args"][key])
    else:
        rows = run(args)
        elapsed = time.time() - t0
    summary = summarize(args, rows)
    report(args, rows, summary, elapsed)
    return 0 if all(r["identical_to_ar"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
