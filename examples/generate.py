"""Run DDTree through vLLM on the trained tiny pair, next to target-only decoding, and compare.

By default: the trained pair shipped in ``models/`` (a 5 M-parameter Qwen3 target trained on the
Python standard library and its DFlash drafter, see README "Trained tiny pair") on code prompts
from standard-library modules held out of training. Prints each completion, the mean acceptance
length τ (accepted draft tokens + 1 per verification step, from vLLM's own spec-decode counters),
the acceptance rate per tree depth and output tokens/s for target-only and DDTree decoding, and
exits with status 1 unless greedy DDTree output equals target-only output token for token on
every prompt.

``--target``/``--drafter`` run other models (e.g. the random test fixtures); ``--oracle-drafts``
replaces the drafter's distributions by ones built from the target's own greedy continuation
(the test-only oracle of ``tests/support/oracle_drafts.py``, in-process engine) — the mechanism,
not a drafter's quality.
``--dflash`` adds vLLM's own DFlash chain method with the same drafter.

Example::

    python examples/generate.py --budget 32 --max-tokens 96
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# The trained pair's paths, the tiny-model engine settings and the oracle drafts are test support
# (tests/support in the source checkout), not part of the installed package.
sys.path.append(str(Path(__file__).resolve().parents[1]))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", help="target model directory (default: the trained pair's target)")
    p.add_argument("--drafter", help="DFlash drafter directory (default: the trained pair's drafter)")
    p.add_argument("--budget", type=int, default=32, help="ddtree_budget: node budget B")
    p.add_argument("--horizon", type=int, default=None,
                   help="num_speculative_tokens: drafter horizon L (default block_size - 1)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--num-prompts", type=int, default=8, help="held-out prompts to run (max 16)")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable; replaces the held-out ones)")
    p.add_argument("--dflash", action="store_true", help="also run vLLM's DFlash chain method")
    p.add_argument("--oracle-drafts", action="store_true",
                   help="inject draft distributions from the target's own continuation")
    p.add_argument("--quiet", action="store_true", help="do not print the completions")
    return p.parse_args(argv)


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


def timed_generate(llm, prompts, params):
    """Generate; returns (outputs, spec-decode deltas (drafts, accepted, per_pos), output tokens, s)."""
    d0, a0, p0 = spec_counts(llm)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    d1, a1, p1 = spec_counts(llm)
    p0 = p0 + [0] * (len(p1) - len(p0))
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return outs, (d1 - d0, a1 - a0, [b - a for a, b in zip(p0, p1)]), n, dt


def tau_of(drafts: int, accepted: int) -> float:
    return (accepted + drafts) / drafts if drafts else float("nan")


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.oracle_drafts:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the oracle is installed in this process
    from vllm import LLM, SamplingParams

    from tests.support import trained
    from tests.support.models import llm_kwargs, read_config, release_llm
    from tests.support.oracle_drafts import OracleDrafts, injected_drafts

    target, drafter = args.target, args.drafter
    if target is None or drafter is None:
        t_dir, d_dir = trained.require()
        target, drafter = target or str(t_dir), drafter or str(d_dir)
    prompts = args.prompt or trained.heldout_prompts(args.num_prompts)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    print(f"target {target}\ndrafter {drafter}\n{len(prompts)} prompts, {args.max_tokens} tokens each, greedy")

    llm = LLM(**llm_kwargs(target))
    timed_generate(llm, prompts[:1], params)  # warm-up
    ref, _, n_ref, t_ref = timed_generate(llm, prompts, params)
    release_llm(llm)
    del llm

    rows = [("target-only", n_ref, t_ref, 1.0, [])]
    runs = []
    if args.dflash:
        L = read_config(drafter)["block_size"] - 1
        runs.append(("DFlash chain (vLLM)", {"method": "dflash", "model": drafter, "num_speculative_tokens": L}))
    spec = {"method": "ddtree", "model": drafter, "ddtree_budget": args.budget}
    runs.append((f"DDTree B={args.budget}", spec))
    same = True
    for label, spec in runs:
        if args.horizon is not None:
            spec["num_speculative_tokens"] = args.horizon
        llm = LLM(**llm_kwargs(target, speculative_config=spec))
        timed_generate(llm, prompts[:1], params)  # warm-up
        if args.oracle_drafts and spec["method"] == "ddtree":
            refs = {tuple(o.prompt_token_ids): list(o.outputs[0].token_ids) for o in ref}
            with injected_drafts(OracleDrafts(refs)):
                out, (drafts, accepted, per_pos), n, t = timed_generate(llm, prompts, params)
        else:
            out, (drafts, accepted, per_pos), n, t = timed_generate(llm, prompts, params)
        release_llm(llm)
        del llm
        rate = [c / drafts for c in per_pos] if drafts else []
        rows.append((label, n, t, tau_of(drafts, accepted), rate))
        eq = [list(r.outputs[0].token_ids) == list(o.outputs[0].token_ids) for r, o in zip(ref, out)]
        if spec["method"] == "ddtree":
            same = all(eq)
            dd_out, dd_eq = out, eq
        print(f"{label}: verification steps {drafts}, accepted draft tokens {accepted}; "
              f"identical to target-only on {sum(eq)}/{len(eq)} prompts")

    if not args.quiet:
        for r, o, eq in zip(ref, dd_out, dd_eq):
            print(f"\n--- prompt (last lines): {''.join(r.prompt.splitlines(keepends=True)[-3:])!r}")
            print(f"    DDTree completion: {o.outputs[0].text!r}")
            print(f"    identical to target-only: {eq}")
    print()
    print("| method | tokens | seconds | tokens/s | τ | acceptance at depth 1, 2, 4, 8 |")
    print("|---|---|---|---|---|---|")
    for label, n, t, tau, rate in rows:
        depths = ", ".join(f"{rate[d - 1]:.2f}" for d in (1, 2, 4, 8) if d <= len(rate)) or "—"
        print(f"| {label} | {n} | {t:.2f} | {n / t:.1f} | {tau:.2f} | {depths} |")
    print(f"\nfront-end pid {os.getpid()}")
    print("greedy DDTree output identical to target-only:", same)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
