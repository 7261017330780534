"""Tree verification on Model Runner V1 (legacy adapter, vLLM 0.32/0.33): the target's choice
at every node through V1's sampler (``vllm/v1/sample/sampler.py``), the walk, the emitted tokens
and their logprobs, in the output layout of V1's rejection sampler.

The walk (:func:`vllm_ddtree.verify.walk_step`) and seeded node noise
(:func:`vllm_ddtree.verify.position_seeds`) are the runner-independent ones of
:mod:`vllm_ddtree.verify`; this module feeds V1's sampler and ``SamplingMetadata`` per tree-node
row and lays the result out for V1 (Model Runner V2 has its own sampler seam:
:mod:`vllm_ddtree.runners.v2`).
"""

from __future__ import annotations

import itertools
from typing import Any, Mapping, Sequence

import torch

from vllm_ddtree.step import StepRequest
from vllm_ddtree.verify import PLACEHOLDER_TOKEN_ID, position_seeds, walk_step


def _node_min_p(min_p: Sequence[float], reps: torch.Tensor) -> Any:
    """vLLM's min-p logits processor (``MinPLogitsProcessor.apply``, argmax-invariant, applied by
    ``Sampler.sample`` right after the temperature) with one threshold per node row.

    vLLM does not build that processor when speculative decoding is on (it refuses min-p there,
    because its rejection sampler would ignore it on draft rows), so DDTree builds the processor's
    state itself and reuses its ``apply``.
    """
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor

    from vllm_ddtree import integration

    proc = integration.bare_instance(MinPLogitsProcessor)
    values = torch.tensor(list(min_p), dtype=torch.float32, device=reps.device)
    proc.min_p = values.repeat_interleave(reps).unsqueeze(1)
    proc.min_p_count = int((values > 0).sum())
    return proc


def sample_nodes(
    logits: torch.Tensor,
    counts: Sequence[int],
    sampling_metadata: Any,
    sampler: Any,
    min_p: Sequence[float] | None = None,
    row_seeds: Mapping[int, Sequence[int]] | None = None,
) -> torch.Tensor:
    """The target's own choice at every tree node: its argmax, or a sample at T > 0.

    Every node row is processed exactly as vLLM's sampler processes a target-only decode row of
    its request (``Sampler.sample`` in ``vllm/v1/sample/sampler.py``: temperature, top-k/top-p,
    per-request seeded generators; greedy rows take ``Sampler.greedy_sample``). The per-request
    parameters are expanded to the request's node rows, like vLLM's rejection sampler does for
    chain drafts (``apply_sampling_constraints``); min-p goes through vLLM's own processor. Each node gets fresh noise, so node samples are
    independent draws from ``p(. | prefix + ancestors)``: walking with them is lossless (DDTree
    paper §3.4, reference sample-and-walk). Options whose state is per batch row (penalties,
    logit bias, …) are refused up front (:func:`vllm_ddtree.verify.validate_sampling_params`).

    Args:
        logits: ``[sum(counts), V]`` target logits, node rows request after request.
        counts: ``n_r + 1`` rows per request, batch order.
        sampling_metadata: the batch's ``vllm.v1.sample.metadata.SamplingMetadata``.
        sampler: the runner's ``vllm.v1.sample.sampler.Sampler``.
        min_p: per request, ``SamplingParams.min_p`` (``None``: no request uses it).
        row_seeds: ``batch index -> [counts[b]]`` generator seeds (:func:`~vllm_ddtree.verify.position_seeds`):
            those requests' rows draw from one fresh generator per row instead of the request's
            generator stream (which then is not advanced); other seeded requests use their
            stream as vLLM does.

    Returns:
        ``[sum(counts)]`` int64 token choices.

    Raises:
        NotImplementedError: the batch carries argmax-invariant logits processors (custom ones;
            refused at start-up) whose per-row state cannot follow tree nodes.
    """
    from dataclasses import replace

    from vllm.v1.sample.logits_processor import LogitsProcessors

    x = logits.to(torch.float32, copy=True)  # the sampler works in place
    if sampling_metadata.all_greedy:
        return sampler.greedy_sample(x).long()
    num_reqs = len(counts)
    reps = torch.tensor(list(counts), device=logits.device)

    def expand(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[:num_reqs].repeat_interleave(reps)

    generators, row = {}, 0
    for b, c in enumerate(counts):
        keyed = None if row_seeds is None else row_seeds.get(b)
        if keyed is not None:
            if len(keyed) != c:
                raise ValueError(f"request row {b}: {len(keyed)} seeds for {c} rows")
            # One generator per row, not per depth: vLLM's sampler advances a generator
            # with each row it draws, so siblings sharing one would not share the noise.
            for r, s in zip(range(row, row + c), keyed):
                generators[r] = torch.Generator(device=logits.device).manual_seed(s)
        elif (g := sampling_metadata.generators.get(b)) is not None:
            for r in range(row, row + c):  # one stream per request, drawn in node order
                generators[r] = g
        row += c
    md = replace(
        sampling_metadata,
        temperature=expand(sampling_metadata.temperature),
        top_k=expand(sampling_metadata.top_k),
        top_p=expand(sampling_metadata.top_p),
        generators=generators,
        max_num_logprobs=None,
        logprob_token_ids=None,
        logitsprocs=LogitsProcessors(
            [_node_min_p(min_p, reps)] if min_p is not None and any(min_p) else []
        ),
    )
    if sampling_metadata.logitsprocs.argmax_invariant:
        raise NotImplementedError("DDTree cannot map custom logits processors onto tree nodes")
    sampled, _ = sampler.sample(x, md)
    return sampled.long()


def verify_tree_step(
    logits: torch.Tensor,
    num_draft_tokens: Sequence[int],
    step_requests: dict[int, StepRequest],
    sampling_metadata: Any,
    sampler: Any,
    min_p: Sequence[float] | None = None,
    seeds: Sequence[int | None] | None = None,
) -> tuple[torch.Tensor, Any]:
    """Tree verification for one step: node choices, the walk, the emitted tokens, logprobs.

    Args:
        logits: ``[sum(n_r + 1), V]`` target logits, request after request, node order inside
            a request (row 0 = root).
        num_draft_tokens: ``n_r`` per request in batch order (0 for requests without drafts).
        step_requests: ``batch_index -> StepRequest`` for the requests that carry drafts; each
            gets its ``accepted`` path filled in.
        sampling_metadata: the batch's ``SamplingMetadata``.
        sampler: the runner's vLLM ``Sampler``.
        min_p: per request ``SamplingParams.min_p``, or ``None``.
        seeds: per request ``SamplingParams.seed`` (``None`` for unseeded), or ``None``: a
            seeded request that verifies a tree draws the noise of each node from the node's
            token position (:func:`~vllm_ddtree.verify.position_seeds`), so its output does not depend on tree
            sizes; a seeded request without drafts draws from its generator as in vLLM.

    Returns:
        ``(sampled, logprobs)``: ``sampled`` is ``[num_reqs, max(n_r) + 1]`` int32 on
        ``logits.device``, per request the accepted path's tokens then the bonus token, ``-1``
        padded (the layout of vLLM's rejection sampler). ``logprobs`` is ``None`` or vLLM's
        ``LogprobsTensors`` for those ``num_reqs * (max(n_r) + 1)`` positions, row-major, each
        computed from the logits of the node that emitted the token — the same prefix as in
        target-only decoding (``RejectionSampler._get_logprobs_tensors`` mirrored).

    Raises:
        ValueError: ``logits`` rows do not match ``sum(n_r + 1)``.
    """
    counts = [int(n) + 1 for n in num_draft_tokens]
    if logits.shape[0] != sum(counts):
        raise ValueError(f"logits has {logits.shape[0]} rows, expected {sum(counts)}")
    row_seeds = None
    if seeds is not None and not sampling_metadata.all_greedy:
        row_seeds = {b: position_seeds(seeds[b], req.context_len + 1 + req.tree.depths.numpy())
                     for b, req in step_requests.items() if seeds[b] is not None}
    for b, req in step_requests.items():
        if req.num_rows != counts[b]:
            raise ValueError(f"request row {b}: a tree of {req.num_rows} rows, {counts[b]} "
                             "logits rows scheduled")
    choices = sample_nodes(logits, counts, sampling_metadata, sampler, min_p,
                           row_seeds).tolist()
    width = max(counts)
    cu = [0, *itertools.accumulate(counts)]
    sampled, num_emitted, moved = walk_step(choices, cu, step_requests, width)
    out = sampled.to(torch.int32)
    rows = torch.empty((len(counts), width), dtype=torch.long)  # logits row of each output
    for b, n in enumerate(num_emitted):
        out[b, n:] = PLACEHOLDER_TOKEN_ID
        rows[b, :n] = torch.tensor(moved[cu[b] : cu[b] + n])
        rows[b, n:] = cu[b]  # padding: any row of the request (vLLM drops these)
    logprobs = None
    if sampling_metadata.max_num_logprobs is not None:
        tokens = out.flatten().long().clamp(min=0)  # placeholders are filtered by vLLM later
        picked = logits[rows.flatten().to(logits.device)].to(torch.float32)
        if getattr(sampler, "logprobs_mode", "raw_logprobs") != "raw_logits":
            picked = sampler.compute_logprobs(picked)
        if sampling_metadata.max_num_logprobs == -1:  # the whole vocabulary, like Sampler
            from vllm.v1.outputs import LogprobsTensors

            logprobs = LogprobsTensors(torch.empty(0), picked, torch.empty(0))
        else:
            logprobs = sampler.gather_logprobs(
                picked, sampling_metadata.max_num_logprobs, tokens.to(logits.device)
            )
    return out.to(logits.device), logprobs
