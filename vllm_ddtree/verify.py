"""Verification, runner-independent: the walk, the emitted tokens, seeded node noise, and the
request options verification refuses.

The target forward gives logits at every node of every tree (``[root, node_1 … node_n]`` per
request). DDTree takes the target's own choice at each node — the argmax, or at T > 0 an
independent sample from the node's processed distribution — and walks from the root while the
choice is a child's token (paper §3.4, reference ``follow_verified_tree``; no ``min(1, p/q)``
acceptance rule, which is biased on trees built from top-k marginals); the step emits the
accepted path's tokens and then the target's choice at the last accepted node, the bonus token.
Per request, accepted draft tokens + 1 = emitted tokens, and accepted token ``j`` sits at depth
``j``, so vLLM's per-position acceptance counts are per-depth counts.

:func:`walk_step` is the walk Model Runner V2's adapter uses (:mod:`vllm_ddtree.runners.v2`);
the legacy V1 adapter samples through V1's sampler and lays its output out as V1's rejection
sampler does (``[num_reqs, max_drafts + 1]`` int32, :data:`PLACEHOLDER_TOKEN_ID` padding:
:mod:`vllm_ddtree.runners.v1.verify`).
"""

from __future__ import annotations

from typing import Any, Sequence

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
