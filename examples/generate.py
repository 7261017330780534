"""Run DDTree through vLLM next to target-only decoding and compare.

Prints each prompt's completion, the mean acceptance length τ (accepted draft tokens + 1 per
verification step, from vLLM's own spec-decode counters) and output tokens/s for both runs, and
exits with status 1 unless greedy DDTree output equals target-only output token for token.

Without ``--target``/``--drafter`` it builds the shipped tiny random-weight fixtures (a Qwen3
target and a DFlash drafter, a few seconds) under ``--model-cache``. A random drafter accepts
almost nothing (τ ≈ 1); ``--oracle-drafts`` replaces its distributions by ones built from the
target's own greedy continuation (the test-only injection hook, in-process engine), which shows
deep trees being accepted — the mechanism, not a drafter's quality.

Example::

    python examples/generate.py --budget 16 --max-tokens 64
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

DEFAULT_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n",
    "for key, value in sorted(items.items()):\n",
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", help="target model directory (default: tiny fixture)")
    p.add_argument("--drafter", help="DFlash drafter directory (default: tiny fixture)")
    p.add_argument("--model-cache", default=os.environ.get("VLLM_DDTREE_MODEL_CACHE",
                                                           "models-cache"))
    p.add_argument("--budget", type=int, default=16, help="ddtree_budget: node budget B")
    p.add_argument("--horizon", type=int, default=None,
                   help="num_speculative_tokens: drafter horizon L (default block_size - 1)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p.add_argument("--oracle-drafts", action="store_true",
                   help="inject draft distributions from the target's own continuation")
    return p.parse_args(argv)


def _spec_counts(llm) -> tuple[int, int]:
    drafts = accepted = 0
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            drafts = int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            accepted = int(m.value)
    return drafts, accepted


def _run(llm, prompts, params):
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return outs, n, dt


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.oracle_drafts:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the hook lives in the worker
    from vllm import LLM, SamplingParams

    from vllm_ddtree.testing.models import TinyModelZoo, llm_kwargs

    target, drafter = args.target, args.drafter
    if target is None or drafter is None:
        zoo = TinyModelZoo(Path(args.model_cache))
        target = target or str(zoo.get("qwen3_target"))
        drafter = drafter or str(zoo.get("dflash_drafter"))
    prompts = args.prompt or DEFAULT_PROMPTS
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    llm = LLM(**llm_kwargs(target))
    _run(llm, prompts[:1], params)  # warm-up
    ref, n_ref, t_ref = _run(llm, prompts, params)
    del llm

    spec = {"method": "ddtree", "model": drafter, "ddtree_budget": args.budget}
    if args.horizon is not None:
        spec["num_speculative_tokens"] = args.horizon
    llm = LLM(**llm_kwargs(target, speculative_config=spec))
    _run(llm, prompts[:1], params)  # warm-up
    d0, a0 = _spec_counts(llm)
    if args.oracle_drafts:
        from vllm_ddtree.testing.injection import ReferenceDraftInjector, injected_drafts

        refs = {tuple(o.prompt_token_ids): list(o.outputs[0].token_ids) for o in ref}
        with injected_drafts(ReferenceDraftInjector(refs)):
            out, n_dd, t_dd = _run(llm, prompts, params)
    else:
        out, n_dd, t_dd = _run(llm, prompts, params)
    d1, a1 = _spec_counts(llm)
    drafts, accepted = d1 - d0, a1 - a0
    tau = (accepted + drafts) / drafts if drafts else float("nan")

    same = True
    for r, o in zip(ref, out):
        eq = list(r.outputs[0].token_ids) == list(o.outputs[0].token_ids)
        same &= eq
        print(f"--- prompt: {r.prompt!r}")
        print(f"    completion: {o.outputs[0].text!r}")
        print(f"    identical to target-only: {eq}")
    print()
    print(f"| method | tokens | seconds | tokens/s | tau |")
    print(f"|---|---|---|---|---|")
    print(f"| target-only | {n_ref} | {t_ref:.2f} | {n_ref / t_ref:.1f} | 1.00 |")
    print(f"| DDTree B={args.budget} | {n_dd} | {t_dd:.2f} | {n_dd / t_dd:.1f} | {tau:.2f} |")
    print(f"\nDDTree verification steps: {drafts}, accepted draft tokens: {accepted}")
    print(f"front-end pid {os.getpid()}")
    print("greedy DDTree output identical to target-only:", same)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
