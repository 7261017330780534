"""Timing shared by the prepared GPU scripts (``gpu_tree_attention.py``, ``gpu_hybrid_oracle.py``).

Imports only torch, so the scripts still run on a machine with torch + Triton and no vLLM.
"""

from __future__ import annotations

import statistics
import time

import torch


def time_call(fn, device: str, iters: int, repeats: int) -> float:
    """Median milliseconds per call of ``fn`` over ``repeats`` samples of ``iters`` calls
    (CUDA events on ``device == "cuda"``, wall clock otherwise), after one warm-up call."""
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            samples.append((time.perf_counter() - t0) * 1e3 / iters)
    return statistics.median(samples)


def select_device() -> str | None:
    """``"cuda"`` on a GPU, ``"cpu"`` under ``TRITON_INTERPRET=1``, else ``None`` (printed why).

    Prints the device line both GPU scripts start their report with.
    """
    import os
    import sys

    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if torch.cuda.is_available() and not interpret:
        print(f"device: {torch.cuda.get_device_name()}")
        return "cuda"
    if interpret:
        print("device: cpu (TRITON_INTERPRET=1)")
        return "cpu"
    print("no GPU: run with TRITON_INTERPRET=1 (and --smoke) on CPU", file=sys.stderr)
    return None
