"""Verification: the target's choice at every tree node, the walk, the emitted tokens.

The target forward gives logits at every node of every tree (vLLM's spec-decode logits rows are
``[root, node_1 … node_n]`` per request, ``_calc_spec_decode_metadata`` in
``vllm/v1/worker/gpu_model_runner.py``). DDTree takes the target's own choice at each node — the
argmax, or at T > 0 an independent sample from the node's processed distribution — and walks
from the root while the choice is a child's token (paper §3.4, reference
``follow_verified_tree``; no ``min(1, p/q)`` acceptance rule, which is biased on trees built from
top-k marginals); the step emits the accepted path's tokens and then the target's choice
at the last accepted node, the bonus token. The output has the shape of vLLM's rejection sampler
(``[num_reqs, max_drafts + 1]`` int32, ``-1`` = ``PLACEHOLDER_TOKEN_ID`` padding) so the rest of
vLLM's pipeline (stop checks, ``num_computed_tokens`` rollback, spec-decode counters) is unchanged:
per request, accepted draft tokens + 1 = emitted tokens, and accepted token ``j`` sits at depth
``j``, so vLLM's per-position acceptance counts are per-depth counts.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch

from vllm_ddtree.step import StepRequest
from vllm_ddtree.tree import follow_tree

PLACEHOLDER_TOKEN_ID = -1

try:  # vLLM maps its validation errors to HTTP 400 in the OpenAI server
    from vllm.exceptions import VLLMValidationError as _ClientError
except ImportError:  # pragma: no cover - vLLM is always present at run time
    _ClientError = ValueError  # type: ignore[misc,assignment]


class DDTreeRequestError(_ClientError, ValueError):  # type: ignore[misc,valid-type]
    """A request option DDTree cannot honour exactly (a ``ValueError``; HTTP 400 in the server)."""


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


def _splitmix64(x: np.ndarray) -> np.ndarray:
    # SplitMix64's finaliser (Steele, Lea & Flood 2014): a bijection of uint64 whose outputs for
    # consecutive inputs are statistically independent; numpy's SeedSequence does the same job
    # but costs ~40 µs per seed, too slow for one seed per tree node and step.
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def position_seeds(seed: int, positions: Sequence[int] | np.ndarray) -> list[int]:
    """Generator seeds for a seeded request's draws, one per token position.

    A seeded request's noise for the token at position ``p`` is keyed by ``(seed, p)`` alone
    (Model Runner V2 keys its Gumbel noise the same way, ``vllm/v1/worker/gpu/sample/gumbel.py``):
    then the token sampled for ``p`` does not depend on the draft tree's size or layout, nor on
    how many rows earlier steps drew, so a seeded request reproduces run to run even when
    ``"ddtree_budget": "auto"`` sizes its trees from measured step times. Nodes at the same
    depth share the key; the walk visits one node per depth, so each committed token still gets
    noise of its own.

    Args:
        seed: ``SamplingParams.seed`` (any Python int; taken modulo 2**64).
        positions: ``[m]`` token positions (>= 0) of the tokens being sampled.

    Returns:
        ``m`` seeds in ``[0, 2**64)`` for ``torch.Generator.manual_seed``.
    """
    key = _splitmix64(np.array([seed & 0xFFFF_FFFF_FFFF_FFFF], dtype=np.uint64))
    return _splitmix64(key ^ np.asarray(positions, dtype=np.uint64)).tolist()


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
    logit bias, …) are refused up front (:func:`validate_sampling_params`).

    Args:
        logits: ``[sum(counts), V]`` target logits, node rows request after request.
        counts: ``n_r + 1`` rows per request, batch order.
        sampling_metadata: the batch's ``vllm.v1.sample.metadata.SamplingMetadata``.
        sampler: the runner's ``vllm.v1.sample.sampler.Sampler``.
        min_p: per request, ``SamplingParams.min_p`` (``None``: no request uses it).
        row_seeds: ``batch index -> [counts[b]]`` generator seeds (:func:`position_seeds`):
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
            token position (:func:`position_seeds`), so its output does not depend on tree
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
    choices = sample_nodes(logits, counts, sampling_metadata, sampler, min_p,
                           row_seeds).tolist()
    width = max(counts)
    out = torch.full((len(counts), width), PLACEHOLDER_TOKEN_ID, dtype=torch.int32)
    rows = torch.zeros((len(counts), width), dtype=torch.long)  # logits row of each output
    start = 0
    for b, c in enumerate(counts):
        node_choices = choices[start : start + c]
        req = step_requests.get(b)
        if req is None:  # no drafts: the one row is an ordinary sample
            accepted = [0]
        else:
            accepted, next_token = follow_tree(req.tree, node_choices)
            req.accepted = accepted
            assert node_choices[accepted[-1]] == next_token
        emitted = [node_choices[a] for a in accepted]  # target choice at each accepted node
        out[b, : len(emitted)] = torch.tensor(emitted, dtype=torch.int32)
        rows[b] = start
        rows[b, : len(accepted)] += torch.tensor(accepted)
        start += c
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


#: SamplingParams fields DDTree cannot yet honour exactly, with the value that means "unused".
_UNSUPPORTED_SAMPLING: dict[str, Any] = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "logit_bias": None,
    "allowed_token_ids": None,
    "bad_words": None,
    "min_tokens": 0,
    "logprob_token_ids": None,
    "prompt_logprobs": None,
    "structured_outputs": None,
    "logits_processors": None,
}


def validate_sampling_params(params: Any) -> None:
    """Refuse what DDTree verification cannot yet honour exactly (never change outputs silently).

    Args:
        params: a ``vllm.SamplingParams``.

    Raises:
        DDTreeRequestError: any option in ``_UNSUPPORTED_SAMPLING`` set (their logits
            processing keeps per-batch-row state that tree node rows do not have, or structured
            outputs filter drafts as a chain); the message names the option (and, for
            ``prompt_logprobs``, the ``echo`` + ``logprobs`` request that sets it). Temperature,
            top-k, top-p, min-p, seeds and logprobs are supported exactly.
    """
    for name, unused in _UNSUPPORTED_SAMPLING.items():
        value = getattr(params, name, unused)
        if value is None or value == unused or value in ([], {}):
            continue
        raise DDTreeRequestError(
            f"speculative method 'ddtree' does not support SamplingParams.{name}={value!r} yet"
            + _HOW_SET.get(name, ""),
            **_where(name, value),
        )


#: How a client sets an option without naming it: vLLM's completions API turns ``echo`` with
#: ``logprobs`` into ``prompt_logprobs`` (``CompletionRequest.to_sampling_params``), so an error
#: naming only ``prompt_logprobs`` would point at an option the user never set.
_HOW_SET: dict[str, str] = {
    "prompt_logprobs": (
        " (log-probabilities of the prompt's tokens: in the OpenAI completions API a request "
        "with `echo` together with `logprobs` asks for them, as does `prompt_logprobs`; drop "
        "`echo` or `logprobs` to get the completion's logprobs)"),
}


def _where(parameter: str, value: Any) -> dict[str, Any]:
    return {} if _ClientError is ValueError else {"parameter": parameter, "value": value}


def walk_step(
    choices: Sequence[int],
    cu_num_logits: Sequence[int],
    step_requests: dict[int, StepRequest],
    width: int,
) -> tuple[torch.Tensor, list[int], list[int]]:
    """The walk of every request of one step, from the target's choice at every logits row.

    Runner-independent (paper §3.4): for a request with a tree the walk follows the target's
    choices down the tree (:func:`~vllm_ddtree.tree.follow_tree`) and fills ``accepted``; any
    other request emits the choice at its first row (a prefill or a request without drafts).
    Rows of a request past its tree (V2's padding rows) are never read.

    Args:
        choices: ``[num_logits]`` the target's token at every logits row (argmax or sample).
        cu_num_logits: ``[num_reqs + 1]`` first logits row of each request.
        step_requests: ``batch_index -> StepRequest`` of the requests that verify drafts.
        width: columns of the output (``K + 1`` for V2's layout).

    Returns:
        ``(sampled, num_emitted, rows)``: ``sampled`` ``[num_reqs, width]`` int64 on the host,
        per request the accepted nodes' tokens then the bonus token, 0 padded; ``num_emitted``
        tokens per request (``len(accepted)``); ``rows`` ``[num_logits]``, the logits row of
        each request's ``j``-th emitted token moved to row ``cu[b] + j`` (identity elsewhere),
        so logprobs computed on ``logits[rows]`` follow emission order.

    Raises:
        ValueError: a request has more accepted nodes than ``width``.
    """
    num_reqs = len(cu_num_logits) - 1
    sampled = torch.zeros(num_reqs, width, dtype=torch.int64)
    num_emitted: list[int] = []
    rows = list(range(int(cu_num_logits[-1]) if num_reqs else 0))
    for b in range(num_reqs):
        lo = int(cu_num_logits[b])
        req = step_requests.get(b)
        if req is None:
            accepted = [0]
        else:
            accepted, _ = follow_tree(req.tree, choices[lo : lo + req.num_rows])
            req.accepted = accepted
        if len(accepted) > width:
            raise ValueError(f"request row {b}: {len(accepted)} tokens exceed width {width}")
        for j, a in enumerate(accepted):
            sampled[b, j] = int(choices[lo + a])
            rows[lo + j] = lo + a
        num_emitted.append(len(accepted))
    return sampled, num_emitted, rows
