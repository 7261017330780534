"""Where an engine step's time goes: target-only vs vLLM's DFlash chain vs DDTree, profiled.

Runs each configuration on the shipped trained pair (greedy, held-out prompts, in-process
engine) once at batch 1 to warm up and once under ``cProfile`` (``--batch`` prompts per call),
then splits the profiled pass into the parts of a step by the cumulative time of the functions
that do them (ms per engine step):

- **target forward**: vLLM's ``GPUModelRunner._model_forward`` (the target's verification
  forward, tree attention included); **attention**: every attention layer's whole forward, the
  target's and the drafter's (vLLM's ``CPUAttentionBackendImpl.forward``, or the plugin's
  ``DDTreeCPUAttentionImpl.forward``: vLLM's kernel over the spine rows plus the tree rows), the
  column to compare across configurations; **tree attention**: the plugin's recomputation of
  the off-spine tree rows inside it;
- **drafter**: ``GPUModelRunner.propose_draft_token_ids`` (the DFlash forward, plus tree building
  for DDTree); **tree build**: the plugin's best-first trees inside it;
- **sampling / verification**: ``GPUModelRunner._sample`` (vLLM's sampler or rejection sampler;
  for DDTree the plugin's tree walk and KV compaction);
- **step layout**: the plugin's ``plan_tree_step`` (rows, positions and masks of each tree);
- ``ddtree_budget="auto"`` only: **auto: allocate** (the controller's per-step sizing and the
  cut of each tree, part of the drafter) and **auto: calibrate** (folding the verified trees
  into the acceptance calibration, part of sampling / verification).

cProfile slows Python-heavy parts more than kernels, so read the columns as shares, and take
speeds from ``benchmarks/e2e.py`` / ``benchmarks/auto_budget.py``.

    python benchmarks/step_profile.py --configs AR DFlash B=8 B=64 auto
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_RUNNER = "vllm/v1/worker/gpu_model_runner.py"
#: column -> the (file suffix, function name) pairs that do it. A column is the largest
#: cumulative time among them: they nest (the plugin's wrapper around vLLM's method, vLLM's
#: public method around its private one) or exclude each other (fp32 vs bf16 tree attention).
PARTS = {
    "target forward": [(_RUNNER, "_model_forward")],
    "attention": [("vllm/v1/attention/backends/cpu_attn.py", "forward"),
                  ("vllm_ddtree/attention/cpu.py", "forward")],
    "tree attention": [("vllm_ddtree/attention/cpu.py", "_attend_tree_rows_at_once"),
                       ("vllm_ddtree/attention/cpu.py", "_overwrite_tree_rows")],
    "drafter": [(_RUNNER, "propose_draft_token_ids")],
    "tree build": [("vllm_ddtree/runners/v1/proposer.py", "build_trees")],
    "sampling / verification": [(_RUNNER, "_sample"), ("vllm_ddtree/runners/v1/hooks.py", "_sample")],
    "step layout": [("vllm_ddtree/step.py", "plan_tree_step")],
    "auto: allocate": [("vllm_ddtree/runners/v1/proposer.py", "_propose_auto")],
    "auto: calibrate": [("vllm_ddtree/budget.py", "observe_trees")],
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=["AR", "DFlash", "B=8", "B=64"])
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=1, help="prompts per generate call")
    p.add_argument("--dump", help="folder to write each configuration's pstats file to")
    return p.parse_args(argv)


def spec_for(name: str, drafter: str) -> dict | None:
    if name == "AR":
        return None
    if name == "DFlash":
        return {"method": "dflash", "model": drafter, "num_speculative_tokens": 15}
    if name == "auto":
        return {"method": "ddtree", "model": drafter, "ddtree_budget": "auto"}
    if name.startswith("B="):
        return {"method": "ddtree", "model": drafter, "ddtree_budget": int(name[2:])}
    raise SystemExit(f"unknown config {name!r} (AR, DFlash, B=<n> or auto)")


def split(profile: cProfile.Profile) -> dict[str, float]:
    """Seconds per column of :data:`PARTS` in ``profile``."""
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    return {col: max([ct for (file, _, name), (_, _, _, ct, _) in stats.items()
                      if any(file.endswith(sfx) and name == fn for sfx, fn in pairs)], default=0.0)
            for col, pairs in PARTS.items()}


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from tests.support.models import apply_cpu_test_env

    apply_cpu_test_env()
    from vllm import SamplingParams

    from tests.support import trained
    from tests.support.models import make_llm, release_llm

    target, drafter = (str(p) for p in trained.require())
    prompts = trained.heldout_prompts(args.num_prompts)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    for name in args.configs:
        spec = spec_for(name, drafter)
        llm = make_llm(target, **({"speculative_config": spec} if spec else {}))
        engine, count = llm.llm_engine, [0]
        step = engine.step

        def counted(*a, _step=step, **k):
            count[0] += 1
            return _step(*a, **k)

        engine.step = counted
        batches = [prompts[i : i + args.batch] for i in range(0, len(prompts), args.batch)]
        for prompt in prompts:  # warm-up pass (batch 1, as benchmarks/auto_budget.py)
            llm.generate([prompt], params, use_tqdm=False)
        count[0] = 0
        profile = cProfile.Profile()
        t0 = time.perf_counter()
        profile.enable()
        for batch in batches:
            llm.generate(batch, params, use_tqdm=False)
        profile.disable()
        wall = time.perf_counter() - t0
        release_llm(llm)
        if args.dump:
            Path(args.dump).mkdir(parents=True, exist_ok=True)
            profile.dump_stats(f"{args.dump}/{name}.pstats")
        steps = max(count[0], 1)
        parts = {k: 1e3 * v / steps for k, v in split(profile).items()}
        rows.append((name, 1e3 * wall / steps, parts))
        print(f"{name}: {steps} steps, {1e3 * wall / steps:.2f} ms/step (profiled)", flush=True)
    print("\n| config | step (profiled) | " + " | ".join(PARTS) + " | rest |")
    print("|---|---|" + "---|" * (len(PARTS) + 1))
    for name, step_ms, parts in rows:
        rest = step_ms - sum(parts[c] for c in ("target forward", "drafter",
                                                 "sampling / verification"))
        print(f"| {name} | {step_ms:.1f} | " + " | ".join(f"{parts[c]:.2f}" for c in PARTS)
              + f" | {rest:.2f} |")
    print("\nms per engine step under cProfile; tree attention is part of the target forward, "
          "tree build part of the drafter, step layout part of the rest.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
