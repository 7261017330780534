"""Verification: the target's choice at every tree node, the walk, the emitted tokens.

The target forward gives logits at every node of every tree (vLLM's spec-decode logits rows are
``[root, node_1 … node_n]`` per request, ``_calc_spec_decode_metadata`` in
``vllm/v1/worker/gpu_model_runner.py``). Greedy DDTree takes the argmax at each node and walks
from the root while the argmax is a child's token (paper §3.4, reference
``follow_verified_tree``); the step emits the accepted path's tokens and then the target's choice
at the last accepted node, the bonus token. The output has the shape of vLLM's rejection sampler
(``[num_reqs, max_drafts + 1]`` int32, ``-1`` = ``PLACEHOLDER_TOKEN_ID`` padding) so the rest of
vLLM's pipeline (stop checks, ``num_computed_tokens`` rollback, spec-decode counters) is unchanged:
per request, accepted draft tokens + 1 = emitted tokens, and accepted token ``j`` sits at depth
``j``, so vLLM's per-position acceptance counts are per-depth counts.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

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

#: Test-only observer (``vllm_ddtree.testing.injection``): called after every verified step as
#: ``observer(step, logits, num_draft_tokens)``. In-process engines only.
_VERIFY_OBSERVER: Callable[..., None] | None = None


def set_verify_observer(fn: Callable[..., None] | None) -> None:
    """Install (or clear with ``None``) the test-only verification observer."""
    global _VERIFY_OBSERVER
    _VERIFY_OBSERVER = fn


def notify_observer(step: Any, logits: torch.Tensor, num_draft_tokens: Sequence[int]) -> None:
    """Hand a verified step to the test-only observer, if any."""
    if _VERIFY_OBSERVER is not None:
        _VERIFY_OBSERVER(step, logits, num_draft_tokens)


def verify_greedy(
    logits: torch.Tensor,
    num_draft_tokens: Sequence[int],
    step_requests: dict[int, StepRequest],
) -> torch.Tensor:
    """Greedy tree verification for one step.

    Args:
        logits: ``[sum(n_r + 1), V]`` target logits, request after request, node order inside
            a request (row 0 = root).
        num_draft_tokens: ``n_r`` per request in batch order (0 for requests without drafts).
        step_requests: ``batch_index -> StepRequest`` for the requests that carry drafts; each
            gets its ``accepted`` path filled in.

    Returns:
        ``[num_reqs, max(n_r) + 1]`` int32 on ``logits.device``: per request the accepted path's
        tokens then the bonus token, ``-1`` padded.

    Raises:
        ValueError: ``logits`` rows do not match ``sum(n_r + 1)``.
    """
    counts = [int(n) + 1 for n in num_draft_tokens]
    if logits.shape[0] != sum(counts):
        raise ValueError(f"logits has {logits.shape[0]} rows, expected {sum(counts)}")
    # vLLM's greedy sampler takes the argmax of float32 logits (vllm/v1/sample/sampler.py).
    choices = logits.float().argmax(dim=-1).tolist()
    out = torch.full((len(counts), max(counts)), PLACEHOLDER_TOKEN_ID, dtype=torch.int32)
    start = 0
    for b, c in enumerate(counts):
        node_choices = choices[start : start + c]
        start += c
        req = step_requests.get(b)
        if req is None:  # no drafts: the one row is an ordinary sample
            out[b, 0] = node_choices[0]
            continue
        accepted, next_token = follow_tree(req.tree, node_choices)
        req.accepted = accepted
        emitted = [node_choices[a] for a in accepted]  # target choice at each accepted node
        assert emitted[-1] == next_token
        out[b, : len(emitted)] = torch.tensor(emitted, dtype=torch.int32)
    return out.to(logits.device)


#: SamplingParams fields DDTree cannot yet honour exactly, with the value that means "unused".
_UNSUPPORTED_SAMPLING: dict[str, Any] = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "logit_bias": None,
    "allowed_token_ids": None,
    "bad_words": None,
    "min_tokens": 0,
    "logprobs": None,
    "prompt_logprobs": None,
    "structured_outputs": None,
    "logits_processors": None,
}


def validate_sampling_params(params: Any) -> None:
    """Refuse what DDTree verification cannot yet honour exactly (never change outputs silently).

    Args:
        params: a ``vllm.SamplingParams``.

    Raises:
        DDTreeRequestError: ``temperature > 0`` (lossless sampling arrives with the T>0 work),
            or any option in ``_UNSUPPORTED_SAMPLING`` set; the message names the option.
    """
    temperature = getattr(params, "temperature", 0.0)
    if temperature is not None and temperature > 0:
        raise DDTreeRequestError(
            f"speculative method 'ddtree' supports greedy decoding only for now "
            f"(SamplingParams.temperature={temperature}); use temperature=0",
            **_where("temperature", temperature),
        )
    for name, unused in _UNSUPPORTED_SAMPLING.items():
        value = getattr(params, name, unused)
        if value is None or value == unused or value in ([], {}):
            continue
        raise DDTreeRequestError(
            f"speculative method 'ddtree' does not support SamplingParams.{name}={value!r} yet",
            **_where(name, value),
        )


def _where(parameter: str, value: Any) -> dict[str, Any]:
    return {} if _ClientError is ValueError else {"parameter": parameter, "value": value}
