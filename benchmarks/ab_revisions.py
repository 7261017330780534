"""A/B of two revisions of the plugin end to end, interleaved: the working tree against a git rev.

Each configuration (target-only ``AR``, vLLM's ``DFlash`` chain, DDTree ``B=<n>`` or ``auto``)
runs on the shipped trained pair in a fresh process per revision, alternating old/new (and the
order within a round), so both revisions see the same machine load; medians over ``--rounds``
(each process is new, so ``auto`` pays its first steps and each new step size every round). The old
revision is checked out once into a detached git worktree under ``/tmp`` and put first on
``PYTHONPATH`` (so its ``vllm_ddtree`` is the one vLLM's plugin entry point imports). Prints a
markdown table: tokens/s and ms per engine step of both, new / old, and whether both revisions
produced the same tokens.

    python benchmarks/ab_revisions.py --old 7400fda --configs DFlash B=8 B=64 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", default="HEAD", help="git revision to compare the working tree with")
    p.add_argument("--configs", nargs="+", default=["AR", "DFlash", "B=8", "B=64"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def child(args) -> int:
    """Run one configuration in this process (the tree under test is first on sys.path)."""
    sys.path.insert(0, os.getcwd())
    from tests.support.models import apply_cpu_test_env

    apply_cpu_test_env()
    from vllm import SamplingParams

    from tests.support import trained
    from tests.support.models import make_llm, release_llm

    target, drafter = (str(p) for p in trained.require())
    prompts = trained.heldout_prompts(args.num_prompts)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    name = args.child
    spec = None
    if name == "DFlash":
        spec = {"method": "dflash", "model": drafter, "num_speculative_tokens": 15}
    elif name.startswith("B="):
        spec = {"method": "ddtree", "model": drafter, "ddtree_budget": int(name[2:])}
    elif name == "auto":
        spec = {"method": "ddtree", "model": drafter, "ddtree_budget": "auto"}
    elif name != "AR":
        raise SystemExit(f"unknown config {name!r} (AR, DFlash, B=<n> or auto)")
    llm = make_llm(target, **({"speculative_config": spec} if spec else {}))
    engine, steps = llm.llm_engine, []
    step = engine.step

    def timed_step(*a, **k):
        t0 = time.perf_counter()
        try:
            return step(*a, **k)
        finally:
            steps.append(time.perf_counter() - t0)

    engine.step = timed_step
    for prompt in prompts:  # warm-up: one pass at batch 1
        llm.generate([prompt], params, use_tqdm=False)
    out = {}
    for batch in args.batches:
        steps.clear()
        ids = []
        t0 = time.perf_counter()
        for i in range(0, len(prompts), batch):
            ids += [list(o.outputs[0].token_ids)
                    for o in llm.generate(prompts[i:i + batch], params, use_tqdm=False)]
        dt = time.perf_counter() - t0
        n = sum(len(x) for x in ids)
        out[batch] = {"tok_s": n / dt, "ms_per_step": 1e3 * sum(steps) / max(1, len(steps)),
                      "ids": ids}
    release_llm(llm)
    print("AB_RESULT " + json.dumps(out), flush=True)
    return 0


def worktree(rev: str) -> Path:
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.strip()
    path = Path("/tmp") / f"vllm-ddtree-ab-{sha}"
    if not path.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), sha], cwd=ROOT,
                       check=True, capture_output=True)
    return path


def run_one(tree: Path, config: str, args) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", config,
           "--num-prompts", str(args.num_prompts), "--max-tokens", str(args.max_tokens),
           "--batches", *map(str, args.batches)]
    res = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("AB_RESULT ")), None)
    if res.returncode or line is None:
        raise RuntimeError(
            f"{config} in {tree} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return {int(b): m for b, m in json.loads(line[len("AB_RESULT "):]).items()}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return child(args)
    trees = {"old": worktree(args.old), "new": ROOT}
    rows: dict[tuple[str, str, int], list[dict]] = {}
    t_start = time.perf_counter()
    for rnd in range(args.rounds):
        for i, config in enumerate(args.configs):
            order = ["old", "new"] if (rnd + i) % 2 == 0 else ["new", "old"]
            for which in order:
                for batch, m in run_one(trees[which], config, args).items():
                    rows.setdefault((config, which, batch), []).append(m)
                    print(f"[round {rnd}] {config:>7} {which} batch {batch}: "
                          f"{m['tok_s']:7.1f} tok/s  {m['ms_per_step']:.1f} ms/step", flush=True)
    print(f"\nold = {args.old}, new = working tree; {args.rounds} interleaved rounds, median; "
          f"{args.num_prompts} prompts × {args.max_tokens} tokens; "
          f"{(time.perf_counter() - t_start) / 60:.0f} min\n")
    print("| config | batch | old tok/s | new tok/s | new / old | old ms/step | new ms/step | "
          "same tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for config in args.configs:
        for batch in args.batches:
            old, new = rows[(config, "old", batch)], rows[(config, "new", batch)]
            med = {k: (statistics.median(m[k] for m in old), statistics.median(m[k] for m in new))
                   for k in ("tok_s", "ms_per_step")}
            same = all(o["ids"] == n["ids"] for o, n in zip(old, new))
            print(f"| {config} | {batch} | {med['tok_s'][0]:.0f} | {med['tok_s'][1]:.0f} | "
                  f"{med['tok_s'][1] / med['tok_s'][0]:.2f} | {med['ms_per_step'][0]:.1f} | "
                  f"{med['ms_per_step'][1]:.1f} | {'yes' if same else 'no'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
