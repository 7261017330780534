"""State of the V1-runner adapter: one object per DDTree engine, on vLLM's V1 model runner.

The V1 hooks (:mod:`.hooks`, ``GPUModelRunner`` in
``vllm/v1/worker/gpu_model_runner.py``) keep everything they carry between calls of one engine
step here, as ``runner._ddtree``; a runner of an engine without DDTree has ``None`` there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_ddtree.config import DDTreeConfig
from vllm_ddtree.step import TreeStep


@dataclass
class V1EngineState:
    """What the V1 hooks keep for one DDTree engine.

    Attributes:
        config: the engine's DDTree settings.
        hybrid: the target has recurrent layers (their speculative rows run the tree oracle).
        tree_masks: the CUDA tree backend's static mask buffers are in use.
        step: this step's plan, from ``_prepare_inputs`` until ``_sample`` consumes it.
        hybrid_ctx: this step's recurrent-layer context, from the target forward to ``_sample``.
        hybrid_done: this step's target forward has run (a second forward is the drafter's).
        cache_layers: CUDA: ``name -> (impl, kv_cache)`` of the target's tree-attention layers
            (found on the first tree step).
        committed_max: the longest committed length after this step's verification, for the
            drafter's ``max_model_len`` check (``None``: no step verified since).
        discarded_generators: CPU: ``batch index -> (generator, state)`` of the seeded requests
            whose sample this step discards (a prefill chunk that is not the last), saved before
            sampling and restored in ``_bookkeeping_sync`` (see :func:`save_discarded_generators`).
        step_index: engine steps prepared so far (``ddtree_budget="auto"`` times consecutive
            steps only).
        step_rows: rows (tokens) scheduled in the current step, for auto's cost model; 0 when
            the step holds a prefill (not timed).
        step_requests: requests scheduled in the current step (auto's per-request cost).
    """

    config: DDTreeConfig
    hybrid: bool = False
    tree_masks: bool = False
    step: TreeStep | None = None
    hybrid_ctx: Any = None
    hybrid_done: bool = False
    cache_layers: dict[str, tuple[Any, Any]] | None = None
    committed_max: int | None = None
    discarded_generators: dict[int, tuple[torch.Generator, torch.Tensor]] = field(
        default_factory=dict)
    step_index: int = 0
    step_rows: int = 0
    step_requests: int = 1


def engine_state(runner: Any) -> V1EngineState | None:
    """The runner's :class:`V1EngineState`, or ``None`` (not a DDTree engine)."""
    return getattr(runner, "_ddtree", None)


def save_discarded_generators(
    generators: dict[int, torch.Generator], discard: Any,
) -> dict[int, tuple[torch.Generator, torch.Tensor]]:
    """The state of every CPU generator whose request's sample this step discards.

    vLLM samples every request, also one whose prefill chunk is not its last, and then undoes
    that draw by moving the generator's Philox offset back (``_bookkeeping_sync``); a CPU
    generator (Mersenne Twister) has no offset and raises. Its whole state, saved here before
    sampling and restored afterwards, undoes the draw exactly, whatever the draw consumed.

    Args:
        generators: vLLM's ``InputBatch.generators``, batch index -> seeded generator.
        discard: ``[num_reqs]`` bool (numpy), vLLM's ``discard_request_mask`` for this step.

    Returns:
        ``batch index -> (generator, state)`` for the discarded CPU generators (CUDA generators
        are left to vLLM's own rewind).
    """
    return {i: (g, g.get_state()) for i, g in generators.items()
            if i < len(discard) and discard[i] and g.device.type == "cpu"}
