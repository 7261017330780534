"""One thin adapter per vLLM model runner.

* Model Runner V2 (vLLM's default wherever Triton runs, every CUDA GPU): :mod:`.v2`.
  The primary adapter: the only runner of vLLM 0.34.
* Model Runner V1 (``vllm/v1/worker/gpu_model_runner.py``; vLLM 0.32/0.33: CPU without
  triton-cpu, or ``VLLM_USE_V2_MODEL_RUNNER=0``): the legacy adapter, the package :mod:`.v1`,
  which can be deleted whole the day 0.32/0.33 support ends.

vLLM chooses the runner; the plugin follows it.
"""


def rank_agreement():
    """``ddtree_budget="auto"`` under tensor parallelism: a function that returns rank 0's
    budgets on every rank of the tensor-parallel group (one ``broadcast_object`` per step), or
    ``None`` with one rank.

    Every rank builds the same trees (from the all-gathered drafter logits) and must verify the
    same number of rows per request, or the ranks' attention masks and token counts differ (wrong
    tokens, or a hung collective); the controllers' cost models learn from each rank's own step
    times, so their choices can differ at the margin.
    """
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    if group.world_size == 1:
        return None
    return lambda budgets: group.broadcast_object(budgets if group.rank_in_group == 0 else None,
                                                  src=0)
