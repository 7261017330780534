"""The V1 runner's view of a step (legacy adapter): vLLM 0.32/0.33's ``SchedulerOutput`` and
input batch turned into the runner-independent step plan (:func:`vllm_ddtree.step.lay_out_step`).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import torch

from vllm_ddtree.step import ScheduledDrafts, TreeStep, lay_out_step
from vllm_ddtree.tree import DraftTree


def plan_tree_step(
    req_ids: Sequence[str],
    scheduled_spec_tokens: Mapping[str, Sequence[int]],
    num_scheduled_tokens: Mapping[str, int],
    query_start_loc: np.ndarray,
    num_computed_tokens: np.ndarray,
    trees: Mapping[str, DraftTree],
    device: torch.device | str = "cpu",
) -> TreeStep | None:
    """Lay this step's draft trees onto vLLM's flat token batch (V1 runner's view).

    Args:
        req_ids: request ids in input-batch order (``input_batch.req_ids[:num_reqs]``).
        scheduled_spec_tokens: ``scheduler_output.scheduled_spec_decode_tokens``.
        num_scheduled_tokens: ``scheduler_output.num_scheduled_tokens``.
        query_start_loc: ``[num_reqs + 1]`` int, first flat row of each request.
        num_computed_tokens: ``[>= num_reqs]`` int, tokens already in the KV cache per request
            (before this step).
        trees: the proposer's trees by request id (consumed entries are removed by the caller).
        device: where the position and mask tensors go (the model's device).

    Returns:
        the step plan (:func:`vllm_ddtree.step.lay_out_step`), or ``None`` when no request carries draft tokens.
    """
    scheduled: list[ScheduledDrafts] = []
    for b, req_id in enumerate(req_ids):
        drafts = scheduled_spec_tokens.get(req_id)
        if not drafts:
            continue
        n = len(drafts)
        num_sched = int(num_scheduled_tokens[req_id])
        scheduled.append(ScheduledDrafts(
            req_id, b, int(query_start_loc[b]) + num_sched - (n + 1),
            int(num_computed_tokens[b]) + num_sched - (n + 1), n, list(drafts)))
    return lay_out_step(scheduled, trees, device)
