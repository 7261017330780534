"""Test-only drafts built from the target's own continuation, for any runner (V1 or V2).

A random-weight drafter accepts almost nothing, so deep trees, accepted paths off the top-1
spine and KV compaction would go untested. :class:`OracleDrafts` turns the drafter's per-depth
log-probs ``[R, L, V]`` into distributions that put the target's known greedy continuation at a
chosen rank per depth. A request is recognised by its bonus token and position alone (the first
reference sequence whose token at that position is the bonus token), so the hook needs nothing
from the runner but the drafter's query block ``[bonus, MASK x L]`` per request.

Outputs never change (verification keeps them equal to target-only decoding); only what is
accepted does.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch


class OracleDrafts:
    """Reference-continuation draft distributions.

    Args:
        references: ``prompt token ids -> target-only greedy output token ids``.
        rank_of_depth: ``(depth, output_index) -> rank`` of the target's token at that depth
            (0 = most probable; 1 or 2 send the accepted path off the top-1 spine).
        num_decoys: decoy tokens with probability mass beside the target's.
        rank_gap: logit gap between consecutive ranks.

    ``hits`` counts the requests whose drafts were replaced.
    """

    def __init__(self, references: Mapping[tuple[int, ...], Sequence[int]],
                 rank_of_depth: Callable[[int, int], int] = lambda d, i: 0,
                 num_decoys: int = 3, rank_gap: float = 1.5) -> None:
        self.sequences = [(len(p), list(p) + list(o)) for p, o in references.items()]
        self.rank_of_depth = rank_of_depth
        self.num_decoys = num_decoys
        self.rank_gap = rank_gap
        self.hits = 0

    def __call__(self, bonus_tokens: Sequence[int], bonus_positions: Sequence[int],
                 log_probs: torch.Tensor) -> torch.Tensor:
        """``log_probs`` ``[R, L, V]`` with the rows of recognised requests replaced."""
        R, L, V = log_probs.shape
        out = log_probs.clone()
        for i, (tok, pos) in enumerate(zip(bonus_tokens, bonus_positions)):
            for prompt_len, seq in self.sequences:
                if pos < prompt_len or pos >= len(seq) or seq[pos] != tok:
                    continue
                self.hits += 1
                for d in range(1, L + 1):
                    if pos + d >= len(seq):
                        break
                    index = pos + d - prompt_len
                    out[i, d - 1] = self._row(seq[pos + d], self.rank_of_depth(d, index), V)
                break
        return out

    def _row(self, token: int, rank: int, V: int) -> torch.Tensor:
        decoys = [(token + 1 + k * 7) % V for k in range(self.num_decoys + rank)]
        decoys = [t for t in dict.fromkeys(decoys) if t != token]
        order = decoys[:rank] + [token] + decoys[rank:]
        logits = torch.full((V,), -12.0)
        for r, t in enumerate(order):
            logits[t] = 6.0 - self.rank_gap * r
        return torch.log_softmax(logits, dim=-1)


def install_v2(oracle: OracleDrafts) -> Callable[[], None]:
    """Feed ``oracle`` to every :class:`vllm_ddtree.runners.v2.DDTreeSpeculator` of this
    process (wraps ``build_trees``); returns a function that removes it."""
    from vllm_ddtree.runners.v2 import DDTreeSpeculator

    original = DDTreeSpeculator.build_trees

    def build_trees(self, req_ids, log_probs):
        R, L = log_probs.shape[0], log_probs.shape[1]
        ids = self.input_buffers.input_ids[: R * (1 + L)].view(R, 1 + L)[:, 0].tolist()
        pos = self.input_buffers.positions[: R * (1 + L)].view(R, 1 + L)[:, 0].tolist()
        return original(self, req_ids, oracle(ids, pos, log_probs))

    DDTreeSpeculator.build_trees = build_trees

    def remove() -> None:
        DDTreeSpeculator.build_trees = original

    return remove
