"""Test-only hooks: inject draft distributions, observe verification.

A random-weight drafter accepts almost nothing, so deep trees, branching acceptance and KV
compaction would go untested. :class:`ReferenceDraftInjector` replaces the drafter's per-depth
log-probs with distributions built from the target's own greedy continuation (known from a
target-only run), putting the target's token at a chosen rank per depth. Rank 0 everywhere makes
the top-1 spine correct (deep acceptance); rank 1 or 2 at some depths makes the accepted path
leave the spine (e.g. accepted nodes ``[0, 3, 7]``), which is what KV compaction must handle.

Both hooks are module globals of the worker, so they work with in-process engines only
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``). For spawned workers (multiprocess engines, tensor
parallel), :data:`TEST_DRAFTS_ENV` names a JSON file written by :func:`write_test_drafts`; every
DDTree proposer then installs the injector it describes. Never use them outside tests: they change
the drafts (never the output — verification keeps the output equal to target-only decoding).
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from vllm_ddtree import proposer as _proposer
from vllm_ddtree import verify as _verify


class ReferenceDraftInjector:
    """Draft distributions from known greedy continuations.

    Args:
        references: ``prompt_token_ids (tuple) -> target-only greedy output token ids``.
        rank_of_depth: ``(depth, output_index) -> rank`` of the target's token in the injected
            distribution at that depth (0 = most probable). ``output_index`` is the index in the
            output of the token at that depth, so patterns can vary along the generation.
        num_decoys: how many decoy tokens get probability mass (ranks above/below the target's).
        rank_gap: logit gap between consecutive ranks; a large gap makes the top-1 spine
            dominate the tree (the B most probable prefixes are then the spine first).

    Calls record ``(req_id, bonus_output_index)`` in :attr:`calls` for assertions.
    """

    def __init__(
        self,
        references: Mapping[tuple[int, ...], Sequence[int]],
        rank_of_depth: Callable[[int, int], int] = lambda depth, index: 0,
        num_decoys: int = 3,
        rank_gap: float = 1.5,
    ) -> None:
        self.references = {tuple(k): list(v) for k, v in references.items()}
        self.rank_of_depth = rank_of_depth
        self.num_decoys = num_decoys
        self.rank_gap = rank_gap
        self.calls: list[tuple[str, int]] = []

    def __call__(
        self,
        proposer: Any,
        req_ids: Sequence[str],
        next_token_ids: torch.Tensor | None,
        log_probs: torch.Tensor,
    ) -> torch.Tensor:
        """Return ``log_probs`` ``[R, L, V]`` with rows replaced where a reference is known."""
        R, L, V = log_probs.shape
        out = log_probs.clone()
        # DFlash's query block is [bonus, MASK x L] per request at consecutive positions.
        query_positions = proposer.positions[: R * (1 + L)].view(R, 1 + L)[:, 0].tolist()
        runner = proposer._ddtree_runner
        for i, req_id in enumerate(req_ids):
            state = runner.requests.get(req_id)
            if state is None:
                continue
            prompt = tuple(state.prompt_token_ids or ())
            ref = self.references.get(prompt)
            if ref is None:
                continue
            bonus_index = int(query_positions[i]) - len(prompt)  # output index of the bonus
            if next_token_ids is not None and not (
                0 <= bonus_index < len(ref) and int(next_token_ids[i]) == ref[bonus_index]
            ):
                continue  # off the reference (e.g. a stop) -> keep the drafter's guess
            self.calls.append((req_id, bonus_index))
            for d in range(1, L + 1):
                idx = bonus_index + d
                if idx >= len(ref):
                    break
                out[i, d - 1] = self._row(ref[idx], self.rank_of_depth(d, idx), V)
        return out

    def _row(self, token: int, rank: int, V: int) -> torch.Tensor:
        decoys = [(token + 1 + k * 7) % V for k in range(self.num_decoys + rank)]
        decoys = [t for t in dict.fromkeys(decoys) if t != token]
        order = decoys[:rank] + [token] + decoys[rank:]
        logits = torch.full((V,), -12.0)
        for r, t in enumerate(order):
            logits[t] = 6.0 - self.rank_gap * r
        return torch.log_softmax(logits, dim=-1)


@contextlib.contextmanager
def injected_drafts(injector: Callable[..., torch.Tensor]) -> Iterator[Callable]:
    """Install ``injector`` as the proposer's draft hook for the enclosed block."""
    _proposer.set_draft_injector(injector)
    try:
        yield injector
    finally:
        _proposer.set_draft_injector(None)


class VerificationRecorder:
    """Records every verified tree step: request ids, trees, accepted paths and node logits.

    ``records`` holds dicts with ``req_id``, ``context_len``, ``tree`` (DraftTree),
    ``accepted`` (list[int]), ``logits`` (``[n + 1, V]`` float32 CPU tensor, node order) and
    ``context_hidden``: per tapped layer, the ``[k + 1, H]`` hidden-state rows the next DFlash
    pass reads for this request after the commit (root + accepted path, path order).
    """

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def __call__(self, step: Any, logits: torch.Tensor, num_draft_tokens: Sequence[int]) -> None:
        starts = [0]
        for n in num_draft_tokens:
            starts.append(starts[-1] + int(n) + 1)
        aux = step.aux_hidden_states or []
        for r in step.requests:
            lo = starts[r.batch_index]
            k1 = len(r.accepted)
            self.records.append(
                dict(
                    req_id=r.req_id,
                    context_len=r.context_len,
                    tree=r.tree,
                    is_tree=r.is_tree,
                    accepted=list(r.accepted),
                    logits=logits[lo : lo + r.num_rows].float().cpu().clone(),
                    context_hidden=[
                        h[r.root_row : r.root_row + k1].float().cpu().clone() for h in aux
                    ],
                )
            )


@contextlib.contextmanager
def recorded_verification() -> Iterator[VerificationRecorder]:
    """Record every DDTree verification step of the enclosed block."""
    rec = VerificationRecorder()
    _verify.set_verify_observer(rec)
    try:
        yield rec
    finally:
        _verify.set_verify_observer(None)


#: Environment variable: path of a JSON file of reference continuations; when set, every DDTree
#: proposer (in any process) injects drafts from it. Test-only.
TEST_DRAFTS_ENV = "VLLM_DDTREE_TEST_DRAFTS"


def write_test_drafts(path: str | os.PathLike, references: Mapping[tuple[int, ...], Sequence[int]],
                      sidestep_period: int = 0, rank_gap: float = 1.5) -> str:
    """Write the file :data:`TEST_DRAFTS_ENV` points to.

    Args:
        references: ``prompt_token_ids -> target-only greedy output token ids``.
        sidestep_period: if > 0, the token at output index ``i`` with
            ``i % sidestep_period == sidestep_period // 2`` gets rank 1 (accepted paths leave
            the top-1 spine); 0 keeps every target token at rank 0.
        rank_gap: see :class:`ReferenceDraftInjector`.

    Returns:
        the path, as a string.
    """
    data = {
        "references": [[list(k), list(v)] for k, v in references.items()],
        "sidestep_period": int(sidestep_period),
        "rank_gap": float(rank_gap),
    }
    with open(path, "w") as f:
        json.dump(data, f)
    return str(path)


def injector_from_file(path: str | os.PathLike) -> ReferenceDraftInjector:
    """The :class:`ReferenceDraftInjector` described by a :func:`write_test_drafts` file."""
    with open(path) as f:
        data = json.load(f)
    period = data["sidestep_period"]

    def rank(depth: int, index: int) -> int:
        return 1 if period > 0 and index % period == period // 2 else 0

    refs = {tuple(p): o for p, o in data["references"]}
    return ReferenceDraftInjector(refs, rank, rank_gap=data["rank_gap"])


def reference_drafts(target: str | os.PathLike, prompts: Sequence[str], max_tokens: int,
                     path: str | os.PathLike, sidestep_period: int = 7
                     ) -> tuple[list[list[int]], str]:
    """Target-only greedy outputs of ``prompts`` (in-process engine) and a
    :data:`TEST_DRAFTS_ENV` file built from them, for tests whose DDTree engine runs in spawned
    workers (multiprocess, tensor parallel, Ray).

    Returns:
        ``(token ids per prompt, path of the drafts file)``.
    """
    from vllm import SamplingParams

    from vllm_ddtree.testing.models import make_llm, release_llm

    llm = make_llm(target)
    try:
        ref = llm.generate(list(prompts), SamplingParams(temperature=0, max_tokens=max_tokens,
                                                         ignore_eos=True), use_tqdm=False)
    finally:
        release_llm(llm)
    refs = {tuple(o.prompt_token_ids): list(o.outputs[0].token_ids) for o in ref}
    drafts = write_test_drafts(path, refs, sidestep_period=sidestep_period)
    return [list(o.outputs[0].token_ids) for o in ref], drafts

