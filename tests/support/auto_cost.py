"""A fixed step-cost curve for ``"ddtree_budget": "auto"`` engines (test-only).

The controller learns step costs from measured wall times, which on a shared 2-core machine
(and under Triton's interpreter) say little about what a step costs. Tests that need the
controller to size trees predictably replace its cost model with a fixed curve.
"""

from __future__ import annotations

from typing import Any

from vllm_ddtree.budget import StepCostModel


class FixedCost(StepCostModel):
    """``intercept + slope × rows`` seconds per step, whatever is observed."""

    def __init__(self, intercept: float, slope: float):
        super().__init__()
        self.fixed = (intercept, slope)

    def coefficients(self, requests: int = 1) -> tuple[float, float]:
        return self.fixed


def fixed_cost(worker: Any, slope: float = 0.000005,
               rank_slopes: list[float] | None = None) -> bool:
    """Run in the worker (``collective_rpc``): a fixed step-cost curve, 10 ms + ``slope`` s per
    verified row, and no probe sizes, on the engine's controller (V1's drafter or V2's
    speculator). The default (5 µs) is gentle: some nodes pay and others do not, so ``auto``
    sizes the trees of one step differently instead of always choosing B_max on a tiny target;
    0 gives every request B_max, a steep slope one-node chains. ``rank_slopes``: one slope per
    worker rank instead (ranks whose controllers would choose different sizes)."""
    runner = worker.model_runner
    drafter = getattr(runner, "drafter", None) or runner.speculator
    if rank_slopes is not None:
        slope = rank_slopes[worker.rank]
    drafter.controller.cost = FixedCost(0.01, slope)
    drafter.controller.probe_every = 0
    return True
