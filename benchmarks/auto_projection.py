"""``"ddtree_budget": "auto"`` projected onto a larger target: the real controller replayed on the
shipped pair's draft trees with the step cost of a Qwen3-0.6B-shaped target.

A **projection**, not a measurement (the issue's "step cost from the larger random-weight target,
τ from the pair"). Two inputs:

1. **Draft trees and what the target accepted, from the pair.** DDTree at a fixed recording budget
   ``--record-budget`` runs on the shipped trained pair (greedy, fp32, held-out prompts, batch 1)
   and every verified tree's path log-probabilities and accepted path are kept. A tree's first
   ``b`` nodes in pop order are the ``b``-node DDTree (parents are popped first), and node indices
   increase along a path, so the ``b``-node tree of that step accepts exactly the recorded path's
   nodes with index <= ``b`` (greedy; the walk is the same until it leaves the prefix).
2. **Step cost from the larger target.** The ms per decode step that ``benchmarks/e2e.py`` part 2
   measured on the Qwen3-0.6B-shaped random target (batch 1, read from ``--costs``, by default
   ``docs/benchmark_e2e.json``): DFlash verifies 16 rows, DDTree at budget B verifies B + 1;
   the curve is piecewise linear in the verified rows through those points (extended with its end
   slopes, never below target-only's step).

Replayed: fixed budgets (each step commits 1 + the accepted drafts of its ``b``-node prefix and
costs ``t(b + 1)``) and ``auto`` -- :class:`vllm_ddtree.budget.BudgetController` as the engine
builds it (row grid, probes, online calibration and cost fit), fed each recorded step's tree and,
after its choice, that choice's accepted path and cost; it first replays the records
``--warmup-passes`` times uncounted (as ``benchmarks/auto_budget.py`` warms every engine up: the
controller starts from large trees and learns the cost from its first steps). Tokens/s = committed tokens / summed step
cost. What the replay leaves out: a different budget would have committed different tokens and
so met different later trees (the recorded run's contexts are reused); the controller's own time
and the tree build are in neither side.

Writes ``docs/benchmark_auto_projection.md`` and ``.json``.

    python benchmarks/auto_projection.py            # ~1 min (records the pair's trees)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BUDGETS = (4, 8, 16, 32, 64, 128)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--record-budget", type=int, default=128,
                   help="node budget of the recorded pair run (the largest budget replayed)")
    p.add_argument("--budgets", type=int, nargs="+", default=list(BUDGETS))
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--costs", default=str(ROOT / "docs" / "benchmark_e2e.json"),
                   help="benchmarks/e2e.py JSON whose part 2 gives the larger target's step times")
    p.add_argument("--warmup-passes", type=int, default=1,
                   help="uncounted replays of the records before auto's counted one")
    p.add_argument("--out-dir", default=str(ROOT / "docs"))
    return p.parse_args(argv)


def record_trees(args) -> list[tuple[np.ndarray, list[int]]]:
    """Run DDTree at ``--record-budget`` on the pair; every verified proposed tree as
    ``(path log-probs [n + 1] float64, accepted node indices from the root 0)``."""
    from tests.support.models import apply_cpu_test_env

    apply_cpu_test_env()  # in-process engine: the proposer runs in this process
    from vllm import SamplingParams

    import vllm_ddtree.runners.v1.proposer as proposer
    from tests.support import trained
    from tests.support.models import make_llm, release_llm

    target, drafter = (str(p) for p in trained.require())
    records: list[tuple[np.ndarray, list[int]]] = []
    original = proposer.DDTreeProposer.observe_verified

    def observe(self, step):
        for r in step.requests:
            if r.proposed and r.accepted:
                records.append((r.tree.path_log_probs.double().numpy().copy(), list(r.accepted)))
        return original(self, step)

    proposer.DDTreeProposer.observe_verified = observe
    try:
        llm = make_llm(target, speculative_config={"method": "ddtree", "model": drafter,
                                                   "ddtree_budget": args.record_budget})
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        for prompt in trained.heldout_prompts(args.num_prompts):
            llm.generate([prompt], params, use_tqdm=False)
        release_llm(llm)
    finally:
        proposer.DDTreeProposer.observe_verified = original
    return records


def cost_curve(path: str):
    """``(t(rows) seconds, t_AR seconds, points)`` from part 2 of a ``benchmarks/e2e.py`` JSON."""
    part2 = json.loads(Path(path).read_text())["part2"]
    ar = next(r["ms_per_step"] for r in part2 if r["config"] == "AR") / 1e3
    pts = sorted({(16 if r["config"] == "DFlash" else r["budget"] + 1): r["ms_per_step"] / 1e3
                  for r in part2 if r["config"] != "AR"}.items())
    if len(pts) < 2:
        raise SystemExit(f"{path}: part 2 needs DFlash and at least one DDTree budget")
    xs, ys = np.array([p[0] for p in pts], float), np.array([p[1] for p in pts], float)
    lo, hi = (ys[1] - ys[0]) / (xs[1] - xs[0]), (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])

    def t(rows):
        rows = np.asarray(rows, dtype=np.float64)
        y = np.interp(rows, xs, ys)
        y = np.where(rows < xs[0], ys[0] + lo * (rows - xs[0]), y)
        y = np.where(rows > xs[-1], ys[-1] + hi * (rows - xs[-1]), y)
        return np.maximum(y, ar)

    return t, ar, pts


def accepted_within(accepted: list[int], b: int) -> int:
    """Drafts the ``b``-node prefix of the tree accepts (indices increase along a path)."""
    return sum(1 for i in accepted[1:] if i <= b)


def replay_fixed(records, b: int, t) -> dict:
    committed = [1 + accepted_within(acc, min(b, plp.size - 1)) for plp, acc in records]
    seconds = float(sum(t(min(b, plp.size - 1) + 1) for plp, _ in records))
    return {"tau": float(np.mean(committed)), "tok_s": sum(committed) / seconds,
            "ms_per_step": 1e3 * seconds / len(records), "mean_budget": float(b)}


def replay_auto(records, max_budget: int, t, warmup_passes: int = 1) -> dict:
    from vllm_ddtree.budget import ENGINE_ROW_MULTIPLE, ENGINE_SIZES_PER_OCTAVE, BudgetController

    ctl = BudgetController(max_budget, row_multiple=ENGINE_ROW_MULTIPLE,
                           sizes_per_octave=ENGINE_SIZES_PER_OCTAVE)
    for _ in range(warmup_passes):  # as the engine benchmark's warm-up: not counted
        _replay_auto_pass(ctl, records, t)
    return _replay_auto_pass(ctl, records, t)


def _replay_auto_pass(ctl, records, t) -> dict:
    import torch

    committed, seconds, budgets = [], 0.0, []
    for plp, acc in records:
        cap = min(ctl.build_cap(), plp.size - 1)  # the engine builds this many nodes
        tree_lp = torch.from_numpy(plp[: cap + 1]).float()
        (b,) = ctl.allocate(["r"], [tree_lp])
        a = accepted_within(acc, b)
        ctl.observe_tree("r", tree_lp[: b + 1], [0] + [i for i in acc[1:] if i <= b])
        step = float(t(b + 1))
        ctl.observe_step(b + 1, step, 1)
        committed.append(1 + a)
        seconds += step
        budgets.append(b)
    return {"tau": float(np.mean(committed)), "tok_s": sum(committed) / seconds,
            "ms_per_step": 1e3 * seconds / len(records), "mean_budget": float(np.mean(budgets)),
            "budget_hist": {int(k): int(v) for k, v in zip(*np.unique(budgets, return_counts=True))}}


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    t, ar, pts = cost_curve(args.costs)
    records = record_trees(args)
    if not records:
        raise SystemExit("no verified tree was recorded")
    rows = [("B=%d" % b, replay_fixed(records, b, t)) for b in args.budgets
            if b <= args.record_budget]
    rows.append(("auto", replay_auto(records, args.record_budget, t, args.warmup_passes)))
    best_name, best = max(((n, r) for n, r in rows if n != "auto"), key=lambda x: x[1]["tok_s"])
    auto = rows[-1][1]
    dflash_t = next(y for x, y in pts if x == 16) if any(x == 16 for x, _ in pts) else None
    elapsed = time.perf_counter() - t0
    lines = [
        "# `ddtree_budget: \"auto\"` projected onto a Qwen3-0.6B-shaped target", "",
        f"Generated by `python benchmarks/auto_projection.py` ({elapsed:.0f} s): the controller "
        "replayed on the shipped pair's draft trees (DDTree at B = "
        f"{args.record_budget}, {len(records)} verified trees from {args.num_prompts} held-out "
        f"prompts × {args.max_tokens} tokens, greedy, batch 1) with the step cost that "
        "`benchmarks/e2e.py` part 2 measured on the 0.6B-shaped random target (batch 1; from "
        f"`{Path(args.costs).name}`); `auto` after {args.warmup_passes} uncounted pass(es) over "
        "the records. **A projection, not a measurement**: see the script's "
        "docstring for what it leaves out.", "",
        "Step-cost points (verified rows → ms per step; target-only "
        f"{1e3 * ar:.0f} ms): " + ", ".join(f"{x} → {1e3 * y:.0f}" for x, y in pts)
        + " (DFlash: 16 rows); piecewise linear between them and extended with the end "
        "segments' slopes (below 16 rows: the DFlash → B = 16 slope), never below target-only's "
        "step.", "",
        "| config | τ | mean B | projected ms/step | projected tok/s | vs target-only |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in rows:
        lines.append(f"| {name} | {r['tau']:.2f} | {r['mean_budget']:.1f} | "
                     f"{r['ms_per_step']:.0f} | {r['tok_s']:.2f} | {r['tok_s'] * ar:.2f} × |")
    lines += ["", f"Best fixed budget {best_name}: `auto` / best fixed = "
              f"**{auto['tok_s'] / best['tok_s']:.2f}**"]
    part1 = json.loads(Path(args.costs).read_text()).get("part1", [])
    dflash_tau = next((r["tau"] for r in part1 if r["config"] == "DFlash" and r["batch"] == 1),
                      None)
    if dflash_t is not None and dflash_tau is not None:  # DFlash's τ on the pair, part 1
        dflash = dflash_tau / dflash_t
        lines[-1] += (f"; `auto` / DFlash (τ {dflash_tau:.2f} on the pair at "
                      f"{1e3 * dflash_t:.0f} ms) = **{auto['tok_s'] / dflash:.2f}**")
    lines += ["", "`auto`'s budgets over the replay (budget: steps): "
              + ", ".join(f"{k}: {v}" for k, v in auto["budget_hist"].items())]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "benchmark_auto_projection.md").write_text("\n".join(lines) + "\n")
    (out / "benchmark_auto_projection.json").write_text(json.dumps(
        {"args": vars(args), "cost_points": pts, "ar_seconds": ar, "records": len(records),
         "rows": dict(rows)}, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
