"""Test-only drafts built from the target's own continuation, for any runner (V1 or V2) and any
process (in-process engines, multiprocess engines, tensor-parallel and Ray workers).

A random-weight drafter accepts almost nothing, so deep trees, accepted paths off the top-1
spine and KV compaction would go untested. :class:`OracleDrafts` turns the drafter's per-depth
log-probs ``[R, L, V]`` into distributions that put the target's known greedy continuation at a
chosen rank per depth. A request is recognised by its bonus token and position alone (the
reference sequences whose token at that position is the bonus token; with request ids, those
that agreed at every earlier step of the request too), so the hook needs nothing from the runner
but the drafter's query block ``[bonus, MASK x L]`` per request.

The production code has no hook: both runners build their trees in a plain method,
``build_trees(self, req_ids, log_probs) -> list[DraftTree]`` (V1
:class:`vllm_ddtree.runners.v1.proposer.DDTreeProposer`, V2
:class:`vllm_ddtree.runners.v2.DDTreeSpeculator`), which :func:`install_v1` / :func:`install_v2`
wrap from outside, feeding it the oracle's distributions instead of the drafter's.

Where the wrapper is installed:

* this process (in-process engines, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``): :func:`injected_drafts`;
* spawned processes (multiprocess engine core, ``mp`` tensor-parallel workers, Ray workers):
  :func:`write_drafts_file`, then start the process with :func:`subprocess_env`; Python runs
  ``tests/support/site/sitecustomize.py`` at start-up in every process of the tree, which reads
  the file named by :data:`DRAFTS_ENV` and installs the wrapper (:func:`install_from_env`) as
  soon as the plugin's proposer module is imported there.

Outputs never change (verification keeps them equal to target-only decoding); only what is
accepted does.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

if TYPE_CHECKING:
    import torch

#: Environment variable (test-only): path of a :func:`write_drafts_file` JSON file; every Python
#: process started with :data:`SITE_DIR` on ``PYTHONPATH`` injects the drafts it describes.
DRAFTS_ENV = "VLLM_DDTREE_TEST_DRAFTS"
#: Directory whose ``sitecustomize.py`` installs test hooks in every process started with it on
#: ``PYTHONPATH``.
SITE_DIR = Path(__file__).resolve().parent / "site"
REPO_ROOT = Path(__file__).resolve().parents[2]

#: ``hook(bonus_tokens, bonus_positions, log_probs, req_ids) -> log_probs``: ``[R, L, V]``
#: float32 in and out; :class:`OracleDrafts` is one, a recording function another.
DraftsHook = Callable[[Sequence[int], Sequence[int], "torch.Tensor", Sequence[str]], "torch.Tensor"]


class OracleDrafts:
    """Reference-continuation draft distributions.

    Args:
        references: ``prompt token ids -> target-only greedy output token ids``.
        rank_of_depth: ``(depth, output_index) -> rank`` of the target's token at that depth
            (0 = most probable; 1 or 2 send the accepted path off the top-1 spine).
            ``output_index`` is the index, in the output, of the token at that depth.
        num_decoys: decoy tokens with probability mass beside the target's.
        rank_gap: logit gap between consecutive ranks; a large gap makes the top-1 spine
            dominate the tree (the B most probable prefixes are then the spine first).

    ``hits`` counts the request rows whose drafts were replaced.
    """

    def __init__(self, references: Mapping[tuple[int, ...], Sequence[int]],
                 rank_of_depth: Callable[[int, int], int] = lambda d, i: 0,
                 num_decoys: int = 3, rank_gap: float = 1.5) -> None:
        self.sequences = [(len(p), list(p) + list(o)) for p, o in references.items()]
        self.rank_of_depth = rank_of_depth
        self.num_decoys = num_decoys
        self.rank_gap = rank_gap
        self.hits = 0
        #: req_id -> indices of the sequences that agreed with every step of the request so far.
        self._candidates: dict[str, list[int]] = {}

    def _agrees(self, k: int, tok: int, pos: int) -> bool:
        prompt_len, seq = self.sequences[k]
        return prompt_len <= pos < len(seq) and seq[pos] == tok

    def __call__(self, bonus_tokens: Sequence[int], bonus_positions: Sequence[int],
                 log_probs: torch.Tensor, req_ids: Sequence[str] | None = None) -> torch.Tensor:
        """``log_probs`` ``[R, L, V]`` with the rows of recognised requests replaced.

        Args:
            bonus_tokens, bonus_positions: per row, the query block's first token (the bonus
                token) and its position in the request's sequence.
            req_ids: per row, the request id (optional); a request that left every reference
                once (sampled, stopped) is not recognised again.
        """
        R, L, V = log_probs.shape
        out = log_probs.clone()
        for i, (tok, pos) in enumerate(zip(bonus_tokens, bonus_positions)):
            key = req_ids[i] if req_ids is not None else None
            pool = self._candidates.get(key) if key is not None else None
            keys = range(len(self.sequences)) if pool is None else pool
            if all(int(pos) < self.sequences[k][0] for k in keys):
                continue  # a draft during a chunked prefill: the request has not started yet
            match = [k for k in keys if self._agrees(k, int(tok), int(pos))]
            if key is not None:
                self._candidates[key] = match
            if not match:
                continue
            self.hits += 1
            prompt_len, seq = self.sequences[match[0]]
            for d in range(1, L + 1):
                if pos + d >= len(seq):
                    break
                index = pos + d - prompt_len
                out[i, d - 1] = self._row(seq[pos + d], self.rank_of_depth(d, index), V)
        return out

    def _row(self, token: int, rank: int, V: int) -> torch.Tensor:
        import torch

        decoys = [(token + 1 + k * 7) % V for k in range(self.num_decoys + rank)]
        decoys = [t for t in dict.fromkeys(decoys) if t != token]
        order = decoys[:rank] + [token] + decoys[rank:]
        logits = torch.full((V,), -12.0)
        for r, t in enumerate(order):
            logits[t] = 6.0 - self.rank_gap * r
        return torch.log_softmax(logits, dim=-1)


# ------------------------------------------------------------------------------ installers


def _wrap_build_trees(cls: type, query_block: Callable[[Any], tuple[Any, Any]],
                      drafts: DraftsHook) -> Callable[[], None]:
    """Wrap ``cls.build_trees`` so that it builds from ``drafts``' distributions.

    Args:
        cls: the V1 proposer or V2 speculator class.
        query_block: ``drafter -> (input ids, positions)`` 1-D buffers holding the drafter's
            query block ``[bonus, MASK x L]`` per request, request after request.
        drafts: the hook.

    Returns:
        a function that puts the previous ``build_trees`` back.
    """
    original = cls.build_trees

    def build_trees(self, req_ids, log_probs):
        R, L = log_probs.shape[0], log_probs.shape[1]
        ids, pos = query_block(self)
        bonus = ids[: R * (1 + L)].view(R, 1 + L)[:, 0].tolist()
        where = pos[: R * (1 + L)].view(R, 1 + L)[:, 0].tolist()
        return original(self, req_ids, drafts(bonus, where, log_probs, list(req_ids)))

    cls.build_trees = build_trees

    def remove() -> None:
        cls.build_trees = original

    return remove


def install_v1(drafts: DraftsHook) -> Callable[[], None]:
    """Feed ``drafts`` to every V1 :class:`vllm_ddtree.runners.v1.proposer.DDTreeProposer` of this process
    (wraps ``build_trees``; vLLM's DFlash drafter keeps the query block in ``input_ids`` /
    ``positions``); returns a function that removes it."""
    from vllm_ddtree.runners.v1.proposer import DDTreeProposer

    return _wrap_build_trees(DDTreeProposer, lambda p: (p.input_ids, p.positions), drafts)


def install_v2(drafts: DraftsHook) -> Callable[[], None]:
    """Feed ``drafts`` to every :class:`vllm_ddtree.runners.v2.DDTreeSpeculator` of this
    process (wraps ``build_trees``); returns a function that removes it."""
    from vllm_ddtree.runners.v2 import DDTreeSpeculator

    return _wrap_build_trees(
        DDTreeSpeculator,
        lambda s: (s.input_buffers.input_ids, s.input_buffers.positions), drafts)


@contextlib.contextmanager
def injected_drafts(drafts: DraftsHook) -> Iterator[DraftsHook]:
    """Inject ``drafts`` into every DDTree drafter of this process (V1 and V2) for the enclosed
    block. In-process engines only; see :func:`subprocess_env` for spawned workers."""
    removers = [install_v1(drafts), install_v2(drafts)]
    try:
        yield drafts
    finally:
        for remove in reversed(removers):
            remove()


# ------------------------------------------------------------------- spawned processes


def write_drafts_file(path: str | os.PathLike,
                      references: Mapping[tuple[int, ...], Sequence[int]],
                      sidestep_period: int = 0, rank_gap: float = 1.5) -> str:
    """Write the JSON file :data:`DRAFTS_ENV` names.

    Args:
        references: ``prompt_token_ids -> target-only greedy output token ids``.
        sidestep_period: if > 0, the token at output index ``i`` with
            ``i % sidestep_period == sidestep_period // 2`` gets rank 1 (accepted paths leave
            the top-1 spine); 0 keeps every target token at rank 0.
        rank_gap: see :class:`OracleDrafts`.

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


def drafts_from_file(path: str | os.PathLike) -> OracleDrafts:
    """The :class:`OracleDrafts` a :func:`write_drafts_file` file describes."""
    with open(path) as f:
        data = json.load(f)
    period = data["sidestep_period"]

    def rank(depth: int, index: int) -> int:
        return 1 if period > 0 and index % period == period // 2 else 0

    refs = {tuple(p): o for p, o in data["references"]}
    return OracleDrafts(refs, rank, rank_gap=data["rank_gap"])


def subprocess_env(drafts_file: str | os.PathLike | None = None,
                   base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """Environment for a child process whose whole process tree gets the test hooks.

    Puts :data:`SITE_DIR` and the repository root first on ``PYTHONPATH`` (so
    ``sitecustomize`` and ``tests.support`` import everywhere) and, with ``drafts_file``, sets
    :data:`DRAFTS_ENV`.

    Args:
        drafts_file: a :func:`write_drafts_file` file, or ``None`` (no draft injection).
        base: the environment to start from (default ``os.environ``).
        extra: more variables to set.
    """
    env = dict(os.environ if base is None else base)
    paths = [str(SITE_DIR), str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if drafts_file is not None:
        env[DRAFTS_ENV] = str(drafts_file)
    env.update(extra)
    return env


def install_from_env() -> None:
    """Install the drafts of the :data:`DRAFTS_ENV` file in this process, for V1 and V2, as
    soon as each runner's drafter module is imported (called by ``site/sitecustomize.py`` at
    interpreter start, before vLLM is imported). The file is read then, so it may be written
    after the process started. Prints one line per runner it installs in."""
    from tests.support.import_hooks import after_import

    path = os.environ.get(DRAFTS_ENV)
    if not path:
        return
    loaded: list[OracleDrafts] = []

    def installer(label: str, install: Callable[[DraftsHook], Any]) -> Callable[[ModuleType], None]:
        def on_import(module: ModuleType) -> None:
            if not loaded:  # one oracle per process: V1 and V2 share what it has seen
                loaded.append(drafts_from_file(path))
            install(loaded[0])
            print(f"tests.support: oracle drafts ({label}) from {path} installed in pid "
                  f"{os.getpid()}", file=sys.stderr, flush=True)
        return on_import

    after_import("vllm_ddtree.runners.v1.proposer", installer("V1", install_v1))
    after_import("vllm_ddtree.runners.v2", installer("V2", install_v2))


def reference_drafts(target: str | os.PathLike, prompts: Sequence[str], max_tokens: int,
                     path: str | os.PathLike, sidestep_period: int = 7
                     ) -> tuple[list[list[int]], str]:
    """Target-only greedy outputs of ``prompts`` (in-process engine) and a drafts file built
    from them, for tests whose DDTree engine runs in spawned workers.

    Returns:
        ``(token ids per prompt, path of the drafts file)``.
    """
    from vllm import SamplingParams

    from tests.support.models import make_llm, release_llm

    llm = make_llm(target)
    try:
        ref = llm.generate(list(prompts), SamplingParams(temperature=0, max_tokens=max_tokens,
                                                         ignore_eos=True), use_tqdm=False)
    finally:
        release_llm(llm)
    refs = {tuple(o.prompt_token_ids): list(o.outputs[0].token_ids) for o in ref}
    drafts = write_drafts_file(path, refs, sidestep_period=sidestep_period)
    return [list(o.outputs[0].token_ids) for o in ref], drafts
