"""Test-only: record every verified DDTree step of a V1 engine in this process.

The production code has no observer. The V1 runner (``_sample`` in
:mod:`vllm_ddtree.runners.v1.hooks`) looks up :func:`vllm_ddtree.runners.v1.verify.verify_tree_step` and
:func:`vllm_ddtree.commit.commit_tree_step` on their modules at call time, so
:func:`recorded_verification` wraps both from outside: verification hands over the step's target
logits, the commit the step itself once KV compaction and the drafter-context gather are done.
In-process engines only (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch


class VerificationRecorder:
    """Records every verified tree step: request ids, trees, accepted paths and node logits.

    ``records`` holds dicts with ``step`` (0, 1, … per verified step), ``req_id``, ``context_len``, ``tree`` (DraftTree), ``is_tree``,
    ``accepted`` (list[int]), ``logits`` (``[n + 1, V]`` float32 CPU tensor, node order) and
    ``context_hidden``: per tapped layer, the ``[k + 1, H]`` hidden-state rows the next DFlash
    pass reads for this request after the commit (root + accepted path, path order).
    """

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.num_steps = 0

    def __call__(self, step: Any, logits: torch.Tensor, num_draft_tokens: Sequence[int]) -> None:
        """Record one committed step.

        Args:
            step: the :class:`~vllm_ddtree.step.TreeStep`, after the commit.
            logits: ``[num_rows, V]`` target logits of the step (vLLM's spec-decode rows,
                ``[root, node_1 … node_n]`` per request).
            num_draft_tokens: draft rows per request of the batch.
        """
        starts = [0]
        for n in num_draft_tokens:
            starts.append(starts[-1] + int(n) + 1)
        aux = step.aux_hidden_states or []
        for r in step.requests:
            lo = starts[r.batch_index]
            k1 = len(r.accepted)
            self.records.append(dict(
                step=self.num_steps,
                req_id=r.req_id,
                context_len=r.context_len,
                tree=r.tree,
                is_tree=r.is_tree,
                accepted=list(r.accepted),
                logits=logits[lo : lo + r.num_rows].float().cpu().clone(),
                context_hidden=[h[r.root_row : r.root_row + k1].float().cpu().clone()
                                for h in aux],
            ))
        self.num_steps += 1


@contextlib.contextmanager
def recorded_verification() -> Iterator[VerificationRecorder]:
    """Record every DDTree verification step of the enclosed block (V1 runner, this process)."""
    from vllm_ddtree import commit
    from vllm_ddtree.runners.v1 import verify

    rec = VerificationRecorder()
    real_verify, real_commit = verify.verify_tree_step, commit.commit_tree_step
    pending: dict[str, Any] = {}

    def verify_tree_step(logits, num_draft_tokens, *args, **kwargs):
        out = real_verify(logits, num_draft_tokens, *args, **kwargs)
        pending["step"] = (logits, list(num_draft_tokens))
        return out

    def commit_tree_step(step, *args, **kwargs):
        real_commit(step, *args, **kwargs)
        logits, counts = pending.pop("step")
        rec(step, logits, counts)

    verify.verify_tree_step, commit.commit_tree_step = verify_tree_step, commit_tree_step
    try:
        yield rec
    finally:
        verify.verify_tree_step, commit.commit_tree_step = real_verify, real_commit
