"""Micro-benchmark: draft-tree construction time (best-first heap, paper Alg. 1) per engine step.

One DDTree step builds one tree per request from ``[R, L, V]`` drafter log-probs
(:func:`vllm_ddtree.tree.build_draft_trees`: one top-k over the batch, one host copy, a Python
heap per request). This prints a markdown table of milliseconds per step for a range of node
budgets B, batch sizes R and vocabulary sizes V at L = 15, measured side by side in one run.

    python benchmarks/tree_build.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vllm_ddtree.tree import build_draft_trees


def time_build(R: int, L: int, V: int, B: int, repeats: int) -> float:
    g = torch.Generator().manual_seed(0)
    # Peaked, drafter-like distributions: a few likely tokens per depth.
    logits = torch.randn(R, L, V, generator=g) * 3.0
    log_probs = torch.log_softmax(logits, dim=-1)
    build_draft_trees(log_probs, B)  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        build_draft_trees(log_probs, B)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    L = 15
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, L = {L}, "
          f"median of {args.repeats}")
    print("| V | R (batch) | B=16 | B=64 | B=256 | B=1024 |")
    print("|---|---|---|---|---|---|")
    for V in (2048, 151936):
        for R in (1, 8):
            row = [f"{time_build(R, L, V, B, args.repeats):.2f} ms" for B in (16, 64, 256, 1024)]
            print(f"| {V} | {R} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
