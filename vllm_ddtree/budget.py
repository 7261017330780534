"""``"ddtree_budget": "auto"``: each step's per-request tree size from the drafter's confidence
and the measured cost of verification (pure Python / numpy, torch at the interface; no vLLM
import, runner-independent). It runs every engine step on vectors of tens to hundreds of
entries, where one numpy operation costs about a microsecond and one torch operation several, so
the arithmetic is numpy.

Why this works (paper §4, Ringel & Romano 2026, arXiv 2604.12989): for a prefix-closed draft
tree, the expected number of accepted drafts is the sum, over its nodes, of the probability that
the accepted path reaches the node. Under the drafter's own distribution that probability is the
node's *path probability* ``q`` (the product of its tokens' per-depth probabilities), and the
best-first construction pops nodes in non-increasing ``q`` with parents first. So every prefix of
the pop order is a valid tree, and the ``j``-th popped node's value is the expected accepted
length it adds: a request's *marginal values* are its nodes' reach probabilities in pop order.

Three pieces, each usable alone:

* :class:`AcceptanceCalibrator` maps the drafter's ``q`` to the probability that is actually
  observed (the drafter is rarely calibrated against the target), online, per probability bucket,
  with the drafter's own ``q`` as the prior. The idea of calibrating draft confidence online
  against what the target accepted is that of vLLM V2's ``OnlineAcceptanceEstimator``
  (``vllm/v1/worker/gpu/spec_decode/acceptance_estimator.py``: a logistic fit of per-position
  acceptance on the drafter's max-probability log-odds, damped by sample counts). Here the label
  is per tree node (on the accepted path or not) and the feature is the node's path probability,
  which is what the tree objective sums.
* :class:`StepCostModel` learns the wall time of one engine step as an affine function of the
  tokens verified in it, by ridge-regularised least squares on a window of recent steps.
* :func:`allocate_budgets` chooses every request's budget for a step to maximise expected
  committed tokens per second of the whole step; :class:`BudgetController` ties the three
  together and keeps the decision a metrics logger can read, including the chain fallback flag.

Only the tree's size changes: whatever budget is chosen, the step is an exact DDTree step, so
outputs stay equal to target-only decoding.
"""

from __future__ import annotations

import functools
import logging
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

__all__ = [
    "AcceptanceCalibrator",
    "Allocation",
    "BudgetController",
    "ENGINE_ROW_MULTIPLE",
    "ENGINE_SIZES_PER_OCTAVE",
    "StepCostModel",
    "allocate_budgets",
    "marginal_values",
]

logger = logging.getLogger("vllm.ddtree")

#: The row grid an engine's controller allocates on (``BudgetController(row_multiple=...)``),
#: for batches of at least this many requests; a batch of ``n`` fewer requests uses a grid of
#: ``n`` (:meth:`BudgetController.allocate`). On the shipped pair (CPU) it cuts the distinct step
#: sizes of a batch of 8 from ~500 to ~65, each of which costs several ms more the first time; a
#: multiple of 8 is also where vLLM's CUDA graph capture sizes lie beyond 8.
ENGINE_ROW_MULTIPLE = 8

#: Step sizes per doubling of the rows beyond ``2 ×`` this many grid units
#: (``BudgetController(sizes_per_octave=...)``, :func:`allocate_budgets`): 4 allows 1 … 7 grid
#: units, then 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, ... Each new step size pays one-time
#: costs (oneDNN builds a GEMM primitive per row count in every linear layer: on the 2-core
#: AVX2 machine ≈ 1.5 ms each, ≈ 40 ms a new size on the shipped pair, most of a step); at
#: batch 1 every row count had been allowed (up to 65 sizes) and a 5-round benchmark paid for
#: several dozen. A quarter octave apart, neighbouring sizes differ by at most 25 % in rows,
#: where the rate curve is flat (B = 8 … 32 within a few % on the pair).
ENGINE_SIZES_PER_OCTAVE = 4


def _check_int(name: str, value: object, minimum: int) -> int:
    # Counts only: below 2**53 so that float(value) is exact (and finite).
    if (isinstance(value, bool) or not isinstance(value, int) or value < minimum
            or value >= 2**53):
        raise ValueError(f"{name} must be an int in [{minimum}, 2**53), got {value!r}")
    return value


def _check_pos_float(name: str, value: object, allow_zero: bool = False) -> float:
    try:
        v = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        raise ValueError(f"{name} must be a finite number {'>= 0' if allow_zero else '> 0'}, "
                         f"got {value!r}")
    return v


# --------------------------------------------------------------------------- calibration


class AcceptanceCalibrator:
    """Online map from a node's drafter path probability ``q`` to its observed reach probability.

    Nodes are binned by ``q`` into log-spaced buckets (bucket ``k`` holds
    ``q in (2**-(k+1), 2**-k]``; the last bucket everything smaller). Each bucket keeps decayed
    sums over verified nodes of ``hits`` (the node was on the accepted path) and ``q_sum`` (the
    drafter's probabilities, i.e. the hits the drafter expected). A node's calibrated value is
    its own ``q`` times its bucket's ratio::

        p(q) = min(1, q * r_k),   r_k = (hits_k + w) / (q_sum_k + w)

    ``r_k`` is the observed-over-expected hit ratio with ``w = prior_weight`` pseudo-hits at
    ratio 1: with no data the drafter is trusted (``p = q``), and every verified tree moves the
    ratio toward what the target accepted. A ratio rather than a per-bucket rate keeps the order
    of nodes within a bucket (a bucket spans a factor of two in ``q``, and the top one holds the
    nodes that matter most). ``decay`` (< 1) forgets old steps so the estimate follows a drifting
    workload.

    Ratios of neighbouring buckets may differ, so ``p`` need not be monotone in ``q`` across a
    bucket edge; :func:`marginal_values` restores the non-increasing order along a tree's pop
    order, which :func:`allocate_budgets` needs.

    Args:
        num_buckets: number of probability buckets (>= 1).
        prior_weight: pseudo-hits at ratio 1 per bucket (> 0).
        decay: factor applied to all sums before each :meth:`observe` call, in ``(0, 1]``.

    Raises:
        ValueError: an argument out of range.
    """

    def __init__(self, num_buckets: int = 24, prior_weight: float = 2.0, decay: float = 0.999):
        self.num_buckets = _check_int("num_buckets", num_buckets, 1)
        self.prior_weight = _check_pos_float("prior_weight", prior_weight)
        self.decay = _check_pos_float("decay", decay)
        if self.decay > 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay!r}")
        #: ``[num_buckets]`` float64 decayed sums: verified nodes, hits, expected hits.
        self.n = np.zeros(num_buckets)
        self.hits = np.zeros(num_buckets)
        self.q_sum = np.zeros(num_buckets)

    def _buckets(self, q: np.ndarray) -> np.ndarray:
        # ufuncs, not np.clip: this runs every step on small arrays, where np.clip's Python
        # wrapper cost more than the arithmetic.
        lg = np.floor(-np.log2(np.minimum(np.maximum(q, 1e-300), 1.0)))
        return np.minimum(np.maximum(lg, 0), self.num_buckets - 1).astype(np.int64)

    def observe(self, path_probs: torch.Tensor, accepted: torch.Tensor) -> None:
        """Fold one verified tree (or several, concatenated) into the estimates.

        Args:
            path_probs: ``[n]`` float, each verified non-root node's drafter path probability
                ``q`` (``exp(DraftTree.path_log_probs[1:])``), values in ``[0, 1]``.
            accepted: ``[n]`` bool, the node is on the accepted path.

        Raises:
            ValueError: shapes differ or are not 1-D, ``accepted`` is not bool, or a probability
                is NaN or outside ``[0, 1]``.
        """
        q, a = _check_observation(path_probs, accepted)
        self._observe(q.numpy(), a.numpy())

    def _observe(self, q: np.ndarray, accepted: np.ndarray) -> None:
        # :meth:`observe` on checked float64 / bool arrays.
        for sums in (self.n, self.hits, self.q_sum):
            sums *= self.decay
        if q.size:
            b, k = self._buckets(q), self.num_buckets
            self.n += np.bincount(b, minlength=k)
            self.hits += np.bincount(b, weights=accepted, minlength=k)
            self.q_sum += np.bincount(b, weights=q, minlength=k)

    def ratios(self) -> torch.Tensor:
        """``[num_buckets]`` float64 observed-over-expected hit ratio per bucket (1 before data)."""
        return torch.from_numpy(self._ratios())

    def _ratios(self) -> np.ndarray:
        w = self.prior_weight
        return (self.hits + w) / (self.q_sum + w)

    def calibrate(self, path_probs: torch.Tensor) -> torch.Tensor:
        """Calibrated reach probability of each node, ``min(1, q * r_bucket(q))``.

        Args:
            path_probs: float tensor of drafter path probabilities in ``[0, 1]`` (any shape).

        Returns:
            float64 tensor of the same shape, values in ``[0, 1]``.
        """
        return torch.from_numpy(self._calibrate(path_probs.detach().double().cpu().numpy()))

    def _calibrate(self, q: np.ndarray) -> np.ndarray:
        return np.minimum(np.maximum(q * self._ratios()[self._buckets(q)], 0.0), 1.0)


def _check_observation(path_probs: object, accepted: object) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(path_probs, torch.Tensor) or not isinstance(accepted, torch.Tensor):
        raise ValueError("path_probs and accepted must be torch tensors")
    if path_probs.dim() != 1 or accepted.shape != path_probs.shape:
        raise ValueError(f"path_probs [n] and accepted [n] must be 1-D of equal length, got "
                         f"{tuple(path_probs.shape)} and {tuple(accepted.shape)}")
    if accepted.dtype != torch.bool:
        raise ValueError(f"accepted must be a bool tensor, got {accepted.dtype}")
    q = path_probs.detach().double().cpu()
    if bool(torch.isnan(q).any()) or bool((q < 0).any()) or bool((q > 1).any()):
        raise ValueError("path_probs must be probabilities in [0, 1] (pass exp(path log-probs))")
    return q, accepted.detach().cpu()


def marginal_values(path_log_probs: torch.Tensor,
                    calibrator: AcceptanceCalibrator | None = None) -> torch.Tensor:
    """A request's marginal values: the expected accepted length each popped node adds.

    Args:
        path_log_probs: ``[n + 1]`` float, ``DraftTree.path_log_probs`` (root first, nodes in
            best-first pop order, so non-increasing after the root).
        calibrator: maps drafter probabilities to observed ones; ``None`` uses the drafter's own.

    Returns:
        ``[n]`` float64, non-increasing: value ``j`` is node ``j + 1``'s reach probability.
        Summing the first ``b`` gives the expected accepted drafts of the ``b``-node tree.

    Raises:
        ValueError: not a 1-D float tensor with the root first.
    """
    return torch.from_numpy(_batch_marginal_values([path_log_probs], calibrator)[0])


def _batch_marginal_values(path_log_probs: Sequence[torch.Tensor],
                           calibrator: AcceptanceCalibrator | None) -> list[np.ndarray]:
    """:func:`marginal_values` of every request of a step, calibrated in one call (float64
    arrays)."""
    for p in path_log_probs:
        if (not isinstance(p, torch.Tensor) or p.dim() != 1 or not p.is_floating_point()
                or p.numel() == 0):
            raise ValueError("path_log_probs must be non-empty 1-D float tensors [n + 1] "
                             "(DraftTree.path_log_probs, root first)")
    sizes = [p.numel() - 1 for p in path_log_probs]
    if not sizes:
        return []
    lp = np.concatenate([p.detach().cpu().numpy()[1:] for p in path_log_probs]).astype(
        np.float64)
    if np.isnan(lp).any():
        raise ValueError("path_log_probs hold NaN")
    q = np.minimum(np.maximum(np.exp(lp), 0.0), 1.0)
    v = q if calibrator is None else calibrator._calibrate(q)
    # Pop order is non-increasing in q, but calibration ratios can jump up at a bucket edge
    # (and sums round): a node is never worth more than one popped before it, which keeps the
    # values sorted for the allocation without raising any estimate.
    out, at = [], 0
    for n in sizes:
        out.append(np.minimum.accumulate(v[at:at + n]))
        at += n
    return out


# --------------------------------------------------------------------------- step cost


#: A bucket's ``c`` is refitted after every step while it has fewer pairs than this, then once
#: per ``_REFIT_EVERY`` new pairs (the intercept follows the window's mean every step): over a
#: window of 256 pairs, 16 more move ``c`` little, and the refit (two robust ratio fits over the
#: window) was about half the controller's host cost a step at batch 1 (0.26 of 0.6 ms, in the
#: engine on the shipped pair).
_REFIT_ALWAYS_BELOW = 64
_REFIT_EVERY = 16


class StepCostModel:
    """Online model of one engine step's wall time, affine in the tokens it verified, per batch
    size: ``seconds = intercept(requests) + slope(requests) * tokens``.

    ``tokens`` is what the step verified (every scheduled row: roots and tree nodes), ``requests``
    how many requests it served. A step's cost is not additive in the two: on a CPU a tree node
    costs several times more at batch 1 than at batch 8 (per-node work that batching amortises),
    and a batch of 8 after a batch of 1 read as steep tokens to a fit over both (every tree
    shrank at batch 8). So steps are kept per batch-size bucket (``requests`` 1, 2–3, 4–7, 8–15,
    …; the last ``window`` steps of each) and two least-squares fits are made:

    * a **pooled** fit over every bucket, ``a + b * tokens + c * requests``, whose slopes are
      pulled toward ``prior_slope`` and 0 with the weight of ``prior_weight`` pseudo-steps (so it
      is defined before any data, and the per-request term stays 0 while one batch size was
      seen); it is what a bucket without steps of its own uses;
    * a **bucket** fit over the steps of the bucket (from ``min_bucket_steps`` steps on; the
      pooled fit before). Its slope relative to its intercept, ``c = slope / intercept``, comes
      from the time ratios of the bucket's consecutive steps, ``(1 + c t2) / (1 + c t1)``: a
      slow spell of the machine scales a step's intercept and slope alike and leaves the ratio
      (and the best tree size, which depends on ``c`` alone) as it was, where a fit on the
      steps' levels read a spell on the small steps of its window as a flat cost (on the
      shipped pair at batch 8, mean budgets 5 → 13 for several passes after one slow pass).
      ``c`` is pulled toward the pooled fit's as toward a prior of standard deviation
      ``bucket_slope_sd`` × it, with the ratios' own residual variance as the noise (the
      pooled fit's while the bucket has fewer than 4 pairs, which fit too closely; empirical
      Bayes): the bucket's own ``c`` once its steps have differed enough in tokens to measure
      it through the noise, the pooled one until then (a pooled slope of 0, clamped, sets no
      prior: the bucket's steps decide); the line then goes through the window's mean step.
      A few steps of a bucket do not set its slope: on the shipped pair a batch-8 bucket
      with two steps (32 rows in 15.3 ms, 48 in 14.0) read as a flat cost under a weak prior,
      and every tree grew to ``B_max`` (520-row steps of 84 ms against 15 ms).

    A pair's ratio is noisy (two steps' jitter against a few rows' difference), and so is the
    pooled prior, hence the long default window: replaying one engine's steps on the shipped
    pair (5th … 95th percentile of ``c`` over the steps), a window of 64 gave 2.8e-3 … 29e-3
    at batch 1 (1166 steps) and 2.1e-3 … 5.7e-3 at batch 8 (213), a window of 256 gave
    5.1e-3 … 14e-3 and 4.0e-3 … 6.9e-3; fixed budgets side by side put ``c`` near 7e-3 …
    10e-3 at batch 1. ``c`` is a property of the hardware and the model, not of a spell; it is
    refitted every step while the bucket has fewer than 64 pairs, then once per 16 new pairs.

    Fits are clamped to slopes >= 0 and ``intercept >= min_intercept`` (a step always costs
    something). On a GPU the slope is close to 0 up to hundreds of tokens; on a CPU it dominates.
    The default prior slope is 0 (GPU-like): the controller starts with large trees and learns
    the real slope from the first steps of different sizes, rather than starting with chains and
    never measuring what a tree costs.

    Args:
        window: observations kept per bucket (>= 2).
        prior_intercept: seconds per step before data (> 0).
        prior_slope: seconds per verified token before data (>= 0).
        prior_weight: pseudo-observations of the prior (> 0).
        min_intercept: floor of the fitted intercept, seconds (> 0).
        bucket_slope_sd: how far a bucket's slope is expected to be from the pooled slope, as a
            fraction of it (> 0).
        min_bucket_steps: steps a bucket needs before its own fit is used (>= 2).

    Raises:
        ValueError: an argument out of range.
    """

    def __init__(self, window: int = 256, prior_intercept: float = 0.02, prior_slope: float = 0.0,
                 prior_weight: float = 0.01, min_intercept: float = 1e-4,
                 bucket_slope_sd: float = 0.25, min_bucket_steps: int = 4):
        self.window = _check_int("window", window, 2)
        self.min_bucket_steps = _check_int("min_bucket_steps", min_bucket_steps, 2)
        if self.min_bucket_steps > self.window:
            raise ValueError(f"min_bucket_steps ({min_bucket_steps}) must be <= window "
                             f"({window}): a bucket keeps only its last window steps")
        self.bucket_slope_sd = _check_pos_float("bucket_slope_sd", bucket_slope_sd)
        self.prior_intercept = _check_pos_float("prior_intercept", prior_intercept)
        self.prior_slope = _check_pos_float("prior_slope", prior_slope, allow_zero=True)
        self.prior_weight = _check_pos_float("prior_weight", prior_weight)
        self.min_intercept = _check_pos_float("min_intercept", min_intercept)
        #: bucket -> the bucket's last ``window`` steps ``(tokens, requests, seconds)``.
        self._obs: dict[int, deque[tuple[float, float, float]]] = {}
        #: bucket -> running sums of the window's moments (:func:`_moments`), so a fit costs a
        #: few scalar operations instead of array building (it runs every step); recomputed
        #: from the window once per ``window`` steps, so rounding does not accumulate.
        self._sums: dict[int, list[float]] = {}
        self._adds: dict[int, int] = {}
        #: bucket -> its consecutive steps (a step and the step observed just before it, when
        #: that was of the same bucket) as columns ``(tokens before, tokens, seconds / seconds
        #: before)`` of a ``[3, window]`` float64 ring (the last ``window``; a fit reads them
        #: in place, order does not matter to it): the data of the bucket's cost per
        #: token relative to its intercept, which a slowdown of the whole machine leaves
        #: unchanged. ``_num_pairs``: pairs ever added per bucket.
        self._pairs: dict[int, np.ndarray] = {}
        self._num_pairs: dict[int, int] = {}
        #: ``(bucket, tokens, seconds)`` of the last step observed, or None.
        self._prev: tuple[int, float, float] | None = None
        self._last_bucket = 1
        self._pooled: tuple[float, float, float] | None = None
        self._fits: dict[int, tuple[float, float]] = {}
        #: bucket -> ``(c, pairs added when it was fitted)`` (see ``_REFIT_EVERY``).
        self._c: dict[int, tuple[float, int]] = {}

    @staticmethod
    def bucket(requests: int) -> int:
        """Batch-size bucket of a step serving ``requests`` requests: ``requests.bit_length()``
        (1 → 1, 2–3 → 2, 4–7 → 3, 8–15 → 4, …)."""
        return int(requests).bit_length()

    def observe(self, tokens: int, seconds: float, requests: int = 1) -> None:
        """Record one step.

        Args:
            tokens: rows the step verified (int >= 1).
            seconds: its wall time (finite, > 0).
            requests: requests it served (int >= 1).

        Raises:
            ValueError: a bad value.
        """
        _check_int("tokens", tokens, 1)
        _check_int("requests", requests, 1)
        s = _check_pos_float("seconds", seconds)
        k = self._last_bucket = self.bucket(requests)
        obs = self._obs.setdefault(k, deque(maxlen=self.window))
        sums = self._sums.setdefault(k, [0.0] * 10)
        new = (float(tokens), float(requests), s)
        if len(obs) == self.window:
            for i, v in enumerate(_moments(*obs[0])):
                sums[i] -= v
        obs.append(new)
        self._adds[k] = self._adds.get(k, 0) + 1
        if self._adds[k] % self.window == 0:
            sums[:] = [sum(c) for c in zip(*(_moments(*o) for o in obs))]
        else:
            for i, v in enumerate(_moments(*new)):
                sums[i] += v
        if self._prev is not None and self._prev[0] == k:
            ring = self._pairs.get(k)
            if ring is None:
                ring = self._pairs[k] = np.empty((3, self.window))
            i = self._num_pairs.get(k, 0)
            ring[:, i % self.window] = (self._prev[1], float(tokens), s / self._prev[2])
            self._num_pairs[k] = i + 1
        self._prev = (k, float(tokens), s)
        self._pooled = None
        self._fits.clear()

    @property
    def num_observations(self) -> int:
        """Observations in the window of the bucket of the last step observed."""
        return len(self._obs.get(self._last_bucket, ()))

    def spread(self, requests: int | None = None) -> float:
        """Largest over smallest tokens per request among the steps of ``requests``' bucket
        (default: the last step's), 1.0 with fewer than 2 steps: that bucket's slope is only
        identified once its trees have differed in size."""
        obs = self._obs.get(self._last_bucket if requests is None else self.bucket(requests), ())
        if len(obs) < 2:
            return 1.0
        xs = [x / r for x, r, _ in obs]
        return max(xs) / min(xs)

    def coefficients(self, requests: int = 1) -> tuple[float, float]:
        """``(intercept seconds, slope seconds per token)`` of a step serving ``requests``
        requests (int >= 1): its bucket's fit, or the pooled one while the bucket has fewer
        than ``min_bucket_steps`` steps."""
        k = self.bucket(_check_int("requests", requests, 1))
        if len(self._obs.get(k, ())) < self.min_bucket_steps:
            a, b, c = self._pooled_fit()
            return a + c * requests, b
        if k not in self._fits:
            pairs = self._num_pairs.get(k, 0)
            cached = self._c.get(k)
            if (cached is None or pairs < _REFIT_ALWAYS_BELOW
                    or pairs - cached[1] >= _REFIT_EVERY):
                cached = self._c[k] = (self._bucket_c(k), pairs)
            n, st, _, ss, *_ = self._sums[k]
            c, xm, ym = cached[0], st / n, ss / n
            # the line through the window's mean step: intercept = mean / (1 + c mean tokens)
            a = max(ym / (1.0 + c * xm), self.min_intercept)
            self._fits[k] = (a, c * a)
        return self._fits[k]

    def per_request(self) -> float:
        """The pooled fit's seconds per request served, beyond the tokens it verified."""
        return self._pooled_fit()[2]

    def _pooled_fit(self) -> tuple[float, float, float]:
        if self._pooled is None:
            self._pooled = self._solve_pooled()
        return self._pooled

    def _pooled_noise(self) -> float:
        """Residual variance of the pooled fit over every bucket's window, seconds²."""
        a, b, c = self._pooled_fit()
        n, st, sr, ss, stt, srr, strq, sts, srs, sss = (
            sum(col) for col in zip(*self._sums.values()))
        rss = (sss + n * a * a + b * b * stt + c * c * srr - 2 * (a * ss + b * sts + c * srs)
               + 2 * (a * b * st + a * c * sr + b * c * strq))
        return max(rss, 0.0) / max(n - 3, 1.0)

    def _solve_pooled(self) -> tuple[float, float, float]:
        # Ridge least squares on (tokens, requests), centred first (the mean step is always
        # identified); each slope is pulled toward its prior with weight lam (prior_weight
        # pseudo-steps at a distance of the feature's mean), so a feature that never varied
        # keeps its prior. A floored intercept refits the slopes through it. On the running
        # sums (normal equations), no per-step arrays.
        a0, b0, w = self.prior_intercept, self.prior_slope, self.prior_weight
        if not self._obs:
            return max(a0, self.min_intercept), b0, 0.0
        n, st, sr, ss, stt, srr, strq, sts, srs, sss = (
            sum(c) for c in zip(*self._sums.values()))
        mt, mr, ms = st / n, sr / n, ss / n
        prior, lam = (b0, 0.0), (w * mt * mt, w * mr * mr)
        xtx = (stt - n * mt * mt, strq - n * mt * mr, srr - n * mr * mr)
        coef = _clamped_ridge(xtx, (sts - n * mt * ms, srs - n * mr * ms),
                              sss - n * ms * ms, lam, prior)
        a = ms - coef[0] * mt - coef[1] * mr
        if a < self.min_intercept:
            a = self.min_intercept
            coef = _clamped_ridge((stt, strq, srr), (sts - a * st, srs - a * sr),
                                  sss - 2 * a * ss + n * a * a, lam, prior)
        return a, float(coef[0]), float(coef[1])

    def _bucket_c(self, k: int) -> float:
        # c = slope / intercept from the time ratios of the bucket's consecutive steps (the
        # class docstring; least squares in :meth:`_ratio_fit`), pairs far out (a spell's first
        # or last step) dropped once; the pooled fit's c is the prior, at least prior_weight
        # pseudo-steps at the mean's distance (steps of one size keep it).
        n, st, sr, ss, *_ = self._sums[k]
        xm, ym = st / n, ss / n
        a0, b0, c_req = self._pooled_fit()
        prior = b0 / max(a0 + c_req * sr / n, self.min_intercept)
        m = min(self._num_pairs.get(k, 0), self.window)
        lam = self.prior_weight * xm * xm
        c = prior
        if m:
            t1, t2, rho = self._pairs[k][:, :m]
            y = rho - 1.0
            c = self._ratio_fit(t1, t2, y, prior, lam, ym)
            resid = np.abs(y - c * (t2 - t1) / (1.0 + c * t1))  # c >= 0
            # the median (the upper one of an even count): np.partition, since np.median's
            # wrapper cost more than the fit here
            mad = float(np.partition(resid, m // 2)[m // 2])
            if m >= 8 and mad > 0.0:  # drop far-out pairs (a spell's edges) once
                keep = resid <= 6.0 * mad
                if not keep.all():
                    c = self._ratio_fit(t1[keep], t2[keep], y[keep], prior, lam, ym)
        return c

    def _ratio_fit(self, t1: np.ndarray, t2: np.ndarray, y: np.ndarray, prior: float,
                   lam: float, ym: float) -> float:
        # c of :meth:`_bucket_c` on some pairs: rho - 1 = c (t2 - t1) / (1 + c t1), least
        # squares with the ridge pull toward ``prior``. A start from the linear form
        # rho - 1 = c (t2 - rho t1) (biased: the noisy rho is in its regressor), then
        # Gauss-Newton steps on the exact form.
        m = y.size
        x = t2 - (1.0 + y) * t1
        sxx, sxy, syy = float(x @ x), float(x @ y), float(y @ y)
        if m >= 4:
            noise = max(syy - sxy * sxy / sxx if sxx > 0 else syy, 0.0) / (m - 1)
        else:  # a pair's ratio noise: twice a step's relative variance
            noise = 2.0 * self._pooled_noise() / (ym * ym)
        if prior > 0:  # a pooled slope of 0 (clamped) gives the prior no scale: data decide
            lam = max(lam, noise / (self.bucket_slope_sd * prior) ** 2)
        c = max((sxy + lam * prior) / (sxx + lam), 0.0)
        dt = t2 - t1
        for _ in range(3):
            den = 1.0 + c * t1
            f, g = c * dt / den, dt / (den * den)
            c = max(c + (float(g @ (y - f)) - lam * (c - prior)) / (float(g @ g) + lam), 0.0)
        return c

    def seconds(self, tokens, requests: int = 1):
        """Predicted wall time of a step verifying ``tokens`` rows for ``requests`` requests
        (``tokens`` a number, or a float tensor / array of row counts giving seconds of the same
        type)."""
        a, b = self.coefficients(requests)
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.double()
        return a + b * tokens


def _moments(t: float, r: float, s: float) -> tuple[float, ...]:
    """One step's terms of the running sums :class:`StepCostModel` fits on:
    ``(1, t, r, s, t², r², t·r, t·s, r·s, s²)`` for tokens ``t``, requests ``r``, seconds ``s``."""
    return (1.0, t, r, s, t * t, r * r, t * r, t * s, r * s, s * s)


def _clamped_ridge(xtx: tuple[float, float, float], xty: tuple[float, float], yty: float,
                   lam: tuple[float, float], prior: tuple[float, float]) -> tuple[float, float]:
    """``argmin |X c - y|^2 + sum lam_j (c_j - prior_j)^2`` subject to ``c >= 0`` for two
    features, from the normal equations: ``xtx = (XᵀX₀₀, XᵀX₀₁, XᵀX₁₁)``, ``xty = Xᵀy``,
    ``yty = yᵀy``. The unconstrained solution, else the best with a feature at 0."""
    a00, a01, a11 = xtx[0] + lam[0], xtx[1], xtx[2] + lam[1]
    r0, r1 = xty[0] + lam[0] * prior[0], xty[1] + lam[1] * prior[1]
    det = a00 * a11 - a01 * a01
    c0, c1 = (a11 * r0 - a01 * r1) / det, (a00 * r1 - a01 * r0) / det
    if c0 >= 0 and c1 >= 0:
        return c0, c1

    def loss(c0: float, c1: float) -> float:
        fit = (c0 * c0 * xtx[0] + 2 * c0 * c1 * xtx[1] + c1 * c1 * xtx[2]
               - 2 * (c0 * xty[0] + c1 * xty[1]) + yty)
        return fit + lam[0] * (c0 - prior[0]) ** 2 + lam[1] * (c1 - prior[1]) ** 2

    alone = ((max(0.0, r0 / a00), 0.0), (0.0, max(0.0, r1 / a11)))  # one feature, the other 0
    return min(alone, key=lambda c: loss(*c))


# --------------------------------------------------------------------------- allocation


@dataclass
class Allocation:
    """One step's budgets and what the controller expects from them.

    Attributes:
        budgets: per-request node budget ``b_i`` in ``[1, B_max]``, in input order.
        expected_accepted: per-request expected accepted drafts (sum of the first ``b_i`` values).
        expected_tokens: expected committed tokens of the step (accepted + one bonus per request).
        seconds: predicted step wall time.
        tokens: rows the step verifies (``extra_tokens + sum(1 + b_i)``).
        chain_fallback: every request got the minimum (one node): no larger tree pays.
        speculation_pays: the expected rate beats the predicted target-only rate (one token per
            request at the cost of ``extra_tokens + num_requests`` rows, without the drafter
            pass: ``drafter_seconds`` of :func:`allocate_budgets`).
        target_only_rate: that predicted target-only rate, tokens per second.
        probe_budgets: with ``probe`` (:func:`allocate_budgets`), the budgets of a step of
            about ``probe`` × this one's rows (the most valuable nodes at that total, on the row
            grid), for the cost model to see another size; else ``None``.
    """

    budgets: list[int]
    expected_accepted: list[float]
    expected_tokens: float
    seconds: float
    tokens: int
    chain_fallback: bool
    speculation_pays: bool
    target_only_rate: float = 0.0
    probe_budgets: list[int] | None = None

    @property
    def tokens_per_second(self) -> float:
        """Expected committed tokens per second of the step."""
        return self.expected_tokens / self.seconds


def _check_values(values: Sequence[torch.Tensor]) -> list[np.ndarray]:
    out = []
    for i, v in enumerate(values):
        if not isinstance(v, torch.Tensor) or v.dim() != 1 or not v.is_floating_point():
            raise ValueError(f"values[{i}] must be a 1-D float tensor (marginal values in pop "
                             f"order), got {type(v).__name__}"
                             f"{tuple(v.shape) if isinstance(v, torch.Tensor) else ''}")
        if v.numel() == 0:
            raise ValueError(f"values[{i}] is empty: every request needs at least one node")
        out.append(v.detach().double().cpu().numpy())
    for i, v in enumerate(out):
        if np.isnan(v).any() or (v < 0).any() or (v > 1).any():
            raise ValueError(f"values[{i}] must be probabilities in [0, 1]")
        if (v[1:] > v[:-1] + 1e-12).any():
            raise ValueError(f"values[{i}] must be non-increasing (best-first pop order)")
    return out


def allocate_budgets(
    values: Sequence[torch.Tensor],
    step_seconds,
    max_budget: int,
    token_budget: int | None = None,
    extra_tokens: int = 0,
    drafter_seconds: float = 0.0,
    row_multiple: int = 1,
    probe: float | None = None,
    weights: Sequence[float] | None = None,
    sizes_per_octave: int = 0,
    take_all: bool = True,
) -> Allocation:
    """Each request's node budget for one step, maximising expected committed tokens per second.

    Every request verifies at least one node (``b_i >= 1``) and at most ``max_budget``, and one
    step verifies ``extra_tokens + sum(1 + b_i)`` rows, at most ``token_budget``. The step commits
    ``sum_i (1 + sum_{j <= b_i} v_ij)`` tokens in expectation (one bonus token per request, plus
    the accepted drafts) and costs ``step_seconds(rows)``.

    Why greedy by marginal value is exact: the cost depends on the *number* of nodes only, so for
    a fixed total the expectation is largest with the highest values; each request's values are
    non-increasing, so the globally highest values always form a prefix of every request's pop
    order (a valid tree). Nodes are therefore taken in one global descending order of value,
    and the best total is found by evaluating the rate at every count (not by stopping at the
    first drop, so it holds for any cost curve, not only convex ones). Ties go to the request
    listed first, then to its earlier node.

    Args:
        values: per request, a 1-D float tensor of marginal values in ``[0, 1]``, non-increasing
            (:func:`marginal_values`); its length caps that request's budget (a tree cannot be
            larger than the nodes its builder found).
        step_seconds: callable from a float64 tensor ``[m]`` of row counts to ``[m]`` seconds
            (or a scalar for a flat cost), e.g. :meth:`StepCostModel.seconds`; must be positive.
        max_budget: ``B_max`` (int >= 1).
        token_budget: the step's row limit (``max_num_batched_tokens``), or ``None``.
        extra_tokens: rows of the same step that are not these trees (prefill chunks), >= 0.
        drafter_seconds: the drafter pass's share of a step (>= 0, seconds): part of every
            speculative step's measured cost, not of a target-only step, so it is taken off the
            cost of the target-only step the allocation is compared with (at most down to 10 %
            of it).
        row_multiple: the row grid (int >= 1): only steps whose rows are a multiple of it are
            considered, besides one node per request and (``take_all``) every candidate (or the
            token budget's limit). A step of a row count never seen before pays one-time costs --
            on a CPU oneDNN builds a GEMM primitive per new row count for every linear layer (≈ 0.5
            ms each); on a GPU, kernels are tuned or graphs captured per size -- so a few sizes
            reused beat a new size every step.
        sizes_per_octave: 0 (every multiple of ``row_multiple``) or a power of two ``s``: of
            ``u = rows / row_multiple`` grid units, every ``u < 2 s`` and from there ``s``
            sizes per doubling (``u`` a multiple of ``2 ** (floor(log2 u) + 1) / (2 s)``), a
            geometric ladder like vLLM's CUDA graph capture sizes, for the same reason.
        take_all: whether the step that verifies every candidate (or as many rows as the
            token budget allows) may be chosen off the grid and ladder. :class:`BudgetController`
            passes False: its trees are built to a cap (:meth:`BudgetController.build_caps`),
            so "every candidate" is a new row count whenever the caps change, and at batch 8
            on the shipped pair a third of the steps verified a row count never seen before
            (15 of 34 in a pass, each paying oneDNN's one-time costs).
        probe: also choose :attr:`Allocation.probe_budgets` at about ``probe`` × the chosen
            rows (> 0), or ``None``.
        weights: per request, what one of its committed tokens is worth (finite, > 0; ``None``:
            1 each). The objective becomes ``sum_i w_i (1 + sum_{j <= b_i} v_ij)`` per second,
            and the greedy order is by ``w_i v_ij`` (still non-increasing per request, so still
            exact). :class:`BudgetController` passes each request's remaining tokens over the
            batch's mean (see :meth:`BudgetController.allocate`). The reported expectations
            (:class:`Allocation`) are unweighted.

    Returns:
        the :class:`Allocation`.

    Raises:
        ValueError: empty batch, a bad values tensor, ``max_budget`` < 1, ``row_multiple`` < 1,
            ``sizes_per_octave`` not 0 or a power of two, ``probe`` not a positive number,
            ``weights`` not one positive finite number per request, ``drafter_seconds`` not a
            number >= 0, a token budget too small for one node per request, or a cost that is
            not positive or not one value per row count.
    """
    vals = _check_values(values)
    if not vals:
        raise ValueError("values is empty: no request to allocate")
    _check_int("max_budget", max_budget, 1)
    _check_int("extra_tokens", extra_tokens, 0)
    if token_budget is not None:
        _check_int("token_budget", token_budget, 1)
    _check_int("row_multiple", row_multiple, 1)
    _check_sizes_per_octave(sizes_per_octave)
    if probe is not None:
        probe = _check_pos_float("probe", probe)
    drafter_seconds = _check_pos_float("drafter_seconds", drafter_seconds, allow_zero=True)

    def cost(rows: np.ndarray) -> np.ndarray:
        s = np.asarray(torch.as_tensor(step_seconds(torch.from_numpy(rows)),
                                       dtype=torch.float64))
        if s.shape not in ((), rows.shape):
            raise ValueError(f"step_seconds must give one value per row count ({rows.shape}) "
                             f"or a scalar, got shape {s.shape}")
        s = np.broadcast_to(s, rows.shape)
        if not np.isfinite(s).all() or (s <= 0).any():
            raise ValueError("step_seconds must give positive finite seconds for every row "
                             f"count, got {s.min()} .. {s.max()}")
        return s

    return _allocate(vals, cost, max_budget, token_budget, extra_tokens, drafter_seconds,
                     row_multiple, probe, _check_weights(weights, len(vals)), sizes_per_octave,
                     bool(take_all))


def _check_sizes_per_octave(value: object) -> int:
    v = _check_int("sizes_per_octave", value, 0)
    if v & (v - 1):
        raise ValueError(f"sizes_per_octave must be 0 or a power of two, got {v}")
    return v


def _on_ladder(rows: np.ndarray, row_multiple: int, sizes_per_octave: int) -> np.ndarray:
    """Which ``rows`` (int64 array) :func:`allocate_budgets` may choose (its ``row_multiple``
    and ``sizes_per_octave``)."""
    on = rows % row_multiple == 0
    if sizes_per_octave:
        u = np.maximum(rows // row_multiple, 1)
        # floor(log2 u) exactly, on integers (bit length - 1)
        e = np.frexp(u.astype(np.float64))[1] - 1
        step = np.left_shift(1, np.maximum(e + 1 - sizes_per_octave.bit_length(), 0))
        on &= u % step == 0
    return on


@functools.lru_cache(maxsize=64)
def _ladder_table(row_multiple: int, sizes_per_octave: int, size: int) -> np.ndarray:
    """:func:`_on_ladder` of the row counts ``0 .. size - 1`` (read-only bool ``[size]``): the
    allocation runs every step, and recomputing the ladder of its candidate counts was a tenth
    of its cost."""
    table = _on_ladder(np.arange(size, dtype=np.int64), row_multiple, sizes_per_octave)
    table.flags.writeable = False
    return table


def _check_weights(weights: Sequence[float] | None, num: int) -> np.ndarray | None:
    if weights is None:
        return None
    w = np.asarray([float(x) for x in weights], dtype=np.float64)
    if w.shape != (num,) or not np.isfinite(w).all() or (w <= 0).any():
        raise ValueError(f"weights must be {num} positive finite numbers, got {list(weights)}")
    return w


def _allocate(vals: list[np.ndarray], cost, max_budget: int, token_budget: int | None,
              extra_tokens: int, drafter_seconds: float, row_multiple: int = 1,
              probe: float | None = None, weights: np.ndarray | None = None,
              sizes_per_octave: int = 0, take_all: bool = True) -> Allocation:
    # allocate_budgets on checked inputs: float64 arrays, ``cost`` from a float64 array of row
    # counts to positive seconds.
    num = len(vals)
    base_rows = extra_tokens + 2 * num  # root + one node per request
    if token_budget is not None and token_budget < base_rows:
        raise ValueError(f"token_budget={token_budget} is too small for {num} requests with "
                         f"one node each and {extra_tokens} other rows ({base_rows} rows)")
    # Candidates beyond the mandatory first node, in one global descending order (of
    # weighted value; the bonus token and first node of request i are worth w_i (1 + v_i0)).
    w = np.ones(num) if weights is None else weights
    cand = [v[1:max_budget] * wi for v, wi in zip(vals, w)]
    cv = np.concatenate(cand)
    cr = np.repeat(np.arange(num), [c.size for c in cand])
    base = float(sum(wi * (1.0 + float(v[0])) for v, wi in zip(vals, w)))
    # Stable sort: ties keep request order, and within a request pop order.
    order = np.argsort(-cv, kind="stable")
    cv, cr = cv[order], cr[order]
    max_extra = cv.size
    if token_budget is not None:
        max_extra = min(max_extra, token_budget - base_rows)
    gains = np.concatenate(([0.0], np.cumsum(cv[:max_extra])))
    rows_k = np.arange(base_rows, base_rows + max_extra + 1, dtype=np.float64)
    seconds_k = cost(rows_k)
    rates = (base + gains) / seconds_k
    hi = base_rows + max_extra + 1
    allowed = _ladder_table(row_multiple, sizes_per_octave, max(64, 1 << (hi - 1).bit_length())
                            )[base_rows:hi].copy()
    allowed[0] = True  # one node each
    if take_all:
        allowed[-1] = True  # every candidate (or the token budget)
    rates = np.where(allowed, rates, -np.inf)
    # The first maximum: among (near-)equal rates the smaller tree, which costs less if the
    # cost model is off.
    best_k = int(np.argmax(rates >= rates.max() * (1 - 1e-12)))
    budgets = (1 + np.bincount(cr[:best_k], minlength=num)).tolist()
    probe_budgets = None
    if probe is not None:
        # The allowed count nearest the scaled row total (ties: in the probe's direction).
        ks = np.flatnonzero(allowed)
        # clipped first: far outside the candidates, float rounding would tie every distance
        want = min(max(probe * (base_rows + best_k) - base_rows, 0.0), float(ks[-1]))
        dist = np.abs(ks - want) - 1e-9 * np.sign(probe - 1.0) * ks
        k = int(ks[np.argmin(dist)])
        probe_budgets = (1 + np.bincount(cr[:k], minlength=num)).tolist()
    expected = [float(v[:b].sum()) for v, b in zip(vals, budgets)]
    expected_tokens = num + sum(expected)
    seconds = float(seconds_k[best_k])
    plain = float(cost(np.array([float(extra_tokens + num)]))[0])
    target_only_rate = num / max(plain - drafter_seconds, 0.1 * plain)
    return Allocation(
        budgets=budgets,
        expected_accepted=expected,
        expected_tokens=expected_tokens,
        seconds=seconds,
        tokens=base_rows + best_k,
        chain_fallback=all(b == 1 for b in budgets),
        speculation_pays=expected_tokens / seconds > target_only_rate,
        target_only_rate=target_only_rate,
        probe_budgets=probe_budgets,
    )


# --------------------------------------------------------------------------- controller


@dataclass
class BudgetStats:
    """Running totals a metrics logger reads (monotone counters and the last decision).

    Attributes:
        steps: allocations made.
        budget_sum: sum of all allocated budgets (mean budget = budget_sum / trees).
        trees: requests allocated.
        predicted_accepted: sum of expected accepted drafts over observed trees.
        observed_accepted: sum of accepted drafts over the same trees.
        chain_fallback_steps: allocations where every request got one node.
        unprofitable_steps: allocations whose expected rate was below the predicted
            target-only rate (speculation costs more than it gains).
        last_budgets: the last allocation's budgets.
    """

    steps: int = 0
    budget_sum: int = 0
    trees: int = 0
    predicted_accepted: float = 0.0
    observed_accepted: int = 0
    chain_fallback_steps: int = 0
    unprofitable_steps: int = 0
    last_budgets: list[int] = field(default_factory=list)


class BudgetController:
    """``"ddtree_budget": "auto"``: calibrator + cost model + allocation, per engine.

    Per step: :meth:`allocate` with each request's drafter path log-probs (from the full-size
    best-first tree) gives the budgets; after verification, :meth:`observe_tree` per request and
    :meth:`observe_step` with the step's rows and wall time update the estimates.

    While the window of step sizes is too narrow to identify the cost slope (:meth:
    `StepCostModel.spread` < ``min_spread``), every ``probe_every``-th allocation is a step of
    about half or twice the rows (alternately, halving first; the most valuable nodes at that
    total): a step of another size is as exact as any other, and without it a controller that
    always picks the same size never learns what other sizes cost. A probe whose size is new
    is repeated at the next allocation: its first step is not timed (below), so without the
    repeat the first probes taught nothing and a new engine at batch 1 verified
    ``B_max``-node trees for ~60 steps (measured on the shipped pair) before two timed sizes
    existed.

    Steps verify a multiple of ``min(row_multiple, requests)`` rows, on a ladder of
    ``sizes_per_octave`` sizes per doubling (:func:`allocate_budgets`; ``take_all`` False:
    also when every node built would pay), and the first step of each ``(rows, requests)`` is
    not timed (:meth:`step_finished`): a size's first step pays
    one-time costs (oneDNN primitives per row count on a CPU, a new GEMM shape in every linear
    layer: ≈ 40 ms a new size on the shipped pair), which read as a steep or negative slope.

    Attributes:
        max_budget: ``B_max``.
        calibrator, cost: the estimators.
        stats: :class:`BudgetStats` for metrics.
        chain_fallback: the last allocation gave every request one node (no tree paid); logged
            as a warning the first time only (``stats.chain_fallback_steps`` counts them all).
        speculation_pays: the last allocation's expected rate beat the predicted target-only rate.

    Args:
        max_budget: ``B_max``.
        calibrator, cost: the estimators (new ones by default). ``cost`` is read through
            :meth:`StepCostModel.coefficients` (once per allocation: the step's cost is affine
            in its rows for a given batch size), :meth:`StepCostModel.spread`
            and :meth:`StepCostModel.observe`.
        probe_every: allocations between probes (0: never).
        min_spread: the :meth:`StepCostModel.spread` below which probes run.
        figures: the metrics sink (:attr:`figures`).
        row_multiple: the row grid of :func:`allocate_budgets` (1: every row count) for a
            batch of at least ``row_multiple`` requests; a batch of ``n`` fewer requests uses a
            grid of ``n``, which keeps its distinct step sizes to about ``B_max`` (as many as a
            batch of 1 has without a grid): at batch 1 a grid of 8 allowed only B = 7, 15,
            23, ... and the best fixed budget on the shipped pair is B = 16. The runner adapters
            pass :data:`ENGINE_ROW_MULTIPLE`.
        sizes_per_octave: the ladder on that grid (:func:`allocate_budgets`; 0: every
            multiple). The runner adapters pass :data:`ENGINE_SIZES_PER_OCTAVE`.

    Raises:
        ValueError: ``max_budget`` < 1, ``row_multiple`` < 1, ``sizes_per_octave`` not 0 or
            a power of two, or a bad probe setting.
    """

    def __init__(self, max_budget: int, calibrator: AcceptanceCalibrator | None = None,
                 cost: StepCostModel | None = None, probe_every: int = 16,
                 min_spread: float = 1.5, figures: Any = None, row_multiple: int = 1,
                 sizes_per_octave: int = 0):
        self.max_budget = _check_int("max_budget", max_budget, 1)
        self.row_multiple = _check_int("row_multiple", row_multiple, 1)
        self.sizes_per_octave = _check_sizes_per_octave(sizes_per_octave)
        self.calibrator = calibrator or AcceptanceCalibrator()
        self.cost = cost or StepCostModel()
        self.probe_every = _check_int("probe_every", probe_every, 0)
        self.min_spread = _check_pos_float("min_spread", min_spread)
        self.stats = BudgetStats()
        #: Optional sink with ``add(**amounts)`` (:class:`vllm_ddtree.metrics.WorkerFigures`):
        #: the same totals as :attr:`stats`, as increments, for ``vllm:ddtree_auto_*``.
        self.figures = figures
        self.chain_fallback = False
        self.speculation_pays = True
        self._logged_fallback = self._logged_unprofitable = False
        self._pending: dict[str, float] = {}
        #: Each live request's budget in the last allocation (:meth:`build_caps`).
        self._last_budget: dict[str, int] = {}
        #: Moving average of the drafter pass's seconds per step (:meth:`observe_drafter`).
        self.drafter_seconds = 0.0
        #: (step index, perf_counter) of the last :meth:`step_finished`.
        self._last_step: tuple[int | None, float] | None = None
        #: ``(rows, requests)`` of the steps :meth:`step_finished` has seen (their first is
        #: not timed).
        self._sizes_seen: set[tuple[int, int]] = set()
        #: The direction of the last allocation's probe (True doubling), None if it was none.
        self._last_probe: bool | None = None
        #: A probe direction to repeat at the next allocation (:meth:`step_finished` skipped
        #: the probe's step, its size's first), or None.
        self._repeat_probe: bool | None = None
        #: ``budgets -> budgets`` applied to every allocation, or ``None``. Under tensor
        #: parallelism every rank builds the same trees and must verify the same sizes, but each
        #: rank times its own steps, so the cost models (and the sizes) can differ; the runner
        #: adapters set this to broadcast rank 0's budgets
        #: (:func:`vllm_ddtree.runners.rank_agreement`).
        self.agree: Any = None

    def allocate(self, req_ids: Sequence[str], path_log_probs: Sequence[torch.Tensor],
                 token_budget: int | None = None, extra_tokens: int = 0,
                 remaining_tokens: Sequence[int] | None = None) -> list[int]:
        """Budgets for one step.

        Args:
            req_ids: the requests, in batch order.
            path_log_probs: per request, ``[n + 1]`` ``DraftTree.path_log_probs`` of its
                best-first tree built at ``max_budget`` (so ``n <= max_budget``; ``n >= 1``).
            token_budget, extra_tokens: as in :func:`allocate_budgets`.
            remaining_tokens: per request, the tokens it may still generate (``max_tokens``
                minus its output so far; ``None``: unknown, every request alike). Each
                request's tokens are weighted by its remaining tokens over the batch's mean
                (``weights`` of :func:`allocate_budgets`): a batch that no request joins lasts
                as many steps as its request with the most work left needs, and at batch 8 on
                the shipped pair the per-step rate is flat across B = 4 … 16 (within 1 %), so
                the plain per-step objective gave the requests the drafter knows least the
                smallest trees and the batch waited for them (37 steps against B = 8's 34). With
                equal remaining work, and at batch 1, the weights are 1.

        Returns:
            per-request budgets in ``[1, min(n_i, max_budget)]``; with :attr:`agree` set, the
            budgets it returns (the same on every rank).

        Raises:
            ValueError: bad arguments, or :attr:`agree` returned budgets outside those bounds.
        """
        if len(req_ids) != len(path_log_probs):
            raise ValueError(f"{len(req_ids)} req_ids but {len(path_log_probs)} trees")
        if not req_ids:
            raise ValueError("no request to allocate")
        if any(isinstance(p, torch.Tensor) and p.numel() < 2 for p in path_log_probs):
            raise ValueError("every tree needs at least one node besides the root")
        values = _batch_marginal_values(path_log_probs, self.calibrator)
        if token_budget is not None:
            _check_int("token_budget", token_budget, 1)
        # The cost model's predictions are positive by construction (intercept floored > 0).
        num = len(req_ids)
        weights = None
        if remaining_tokens is not None:
            left = _check_weights([max(float(x), 1.0) for x in remaining_tokens], num)
            weights = left / left.mean() if num > 1 else None  # one request: a weight of 1
        self.stats.steps += 1
        up = self._probe_up(self.stats.steps)
        if up is None:
            up = self._repeat_probe
        self._repeat_probe = None
        probe = (2.0 if up else 0.5) if (
            up is not None and self.cost.spread(num) < self.min_spread) else None
        self._last_probe = None if probe is None else up
        intercept, slope = self.cost.coefficients(num)
        alloc = _allocate(values, lambda rows: intercept + slope * rows, self.max_budget,
                          token_budget,
                          _check_int("extra_tokens", extra_tokens, 0), self.drafter_seconds,
                          min(self.row_multiple, num), probe, weights, self.sizes_per_octave,
                          take_all=False)
        budgets = alloc.budgets if alloc.probe_budgets is None else alloc.probe_budgets
        if self.agree is not None:
            budgets = [int(b) for b in self.agree(list(budgets))]
            if len(budgets) != len(values) or any(
                    not 1 <= b <= min(v.size, self.max_budget) for b, v in zip(budgets, values)):
                raise ValueError(f"agreed budgets {budgets} do not fit this rank's trees "
                                 f"({[v.size for v in values]} nodes)")
        for r, b, v in zip(req_ids, budgets, values):
            self._pending[r] = float(v[:b].sum())
            self._last_budget[r] = b
        self.stats.budget_sum += sum(budgets)
        self.stats.trees += len(budgets)
        self.stats.last_budgets = list(budgets)
        self.chain_fallback = alloc.chain_fallback
        self.speculation_pays = alloc.speculation_pays
        if self.figures is not None:
            self.figures.add(auto_trees=len(budgets), auto_nodes=sum(budgets),
                             auto_chain_fallback_steps=int(alloc.chain_fallback),
                             auto_unprofitable_steps=int(not alloc.speculation_pays))
        if not alloc.speculation_pays:
            self.stats.unprofitable_steps += 1
            if not self._logged_unprofitable and self.cost.num_observations >= self.cost.window:
                self._logged_unprofitable = True  # once the cost model has a full window
                logger.warning(
                    "DDTree auto budget: target-only decoding is predicted faster than any draft "
                    "tree here (%.0f tokens/s vs %.0f with the best trees, %d requests): "
                    "consider turning speculative decoding off (vllm:ddtree_auto_unprofitable_"
                    "steps counts such steps)", alloc.target_only_rate,
                    alloc.tokens_per_second, len(budgets))
        if alloc.chain_fallback:
            self.stats.chain_fallback_steps += 1
            if not self._logged_fallback:
                self._logged_fallback = True
                logger.warning(
                    "DDTree auto budget: no tree larger than one node pays for its verification "
                    "cost (%d requests, predicted step %.4f s at %d rows); verifying one-node "
                    "chains. %s", len(budgets), alloc.seconds, alloc.tokens,
                    "Target-only decoding is predicted to be faster: consider turning "
                    "speculative decoding off." if not alloc.speculation_pays else "")
        return budgets

    def observe_tree(self, req_id: str, path_log_probs: torch.Tensor, accepted_nodes:
                     Sequence[int]) -> None:
        """Fold one verified tree into the calibration (:meth:`observe_trees` of one)."""
        self.observe_trees([(req_id, path_log_probs, accepted_nodes)])

    def observe_trees(self, trees: Sequence[tuple[str, torch.Tensor, Sequence[int]]]) -> None:
        """Fold one step's verified trees into the calibration, in one update.

        Args:
            trees: per tree ``(req_id, path_log_probs, accepted_nodes)``: its request (matches
                the prediction made in :meth:`allocate`, if any), ``[n + 1]``
                ``DraftTree.path_log_probs`` of the tree as verified, and the node indices of
                the accepted path starting with the root 0.

        Raises:
            ValueError: an accepted node index outside its tree.
        """
        qs, accs = [], []
        for req_id, path_log_probs, accepted_nodes in trees:
            n = path_log_probs.numel() - 1
            acc = np.zeros(n, dtype=bool)
            idx = [i - 1 for i in accepted_nodes if i != 0]
            if any(not 0 <= i < n for i in idx):
                raise ValueError(f"accepted node indices {list(accepted_nodes)} outside a tree "
                                 f"of {n} nodes")
            acc[idx] = True
            qs.append(path_log_probs[1:])
            accs.append(acc)
            pred = self._pending.pop(req_id, None)
            if pred is not None:
                self.stats.predicted_accepted += pred
                self.stats.observed_accepted += len(idx)
                if self.figures is not None:
                    self.figures.add(auto_predicted_accepted=pred,
                                     auto_observed_accepted=len(idx))
        if qs:
            q = np.exp(np.concatenate([p.detach().cpu().numpy() for p in qs]).astype(np.float64))
            if np.isnan(q).any():
                raise ValueError("path_log_probs hold NaN")
            self.calibrator._observe(np.minimum(q, 1.0), np.concatenate(accs))

    def observe_verified(self, step: Any) -> None:
        """Calibrate with what one verified step accepted (:meth:`observe_trees`).

        Args:
            step: a :class:`~vllm_ddtree.step.TreeStep` with ``accepted`` set on every request;
                chains built from the scheduled tokens rather than the drafter's tree
                (``proposed`` False) carry no drafter probabilities and are skipped.
        """
        self.observe_trees([(r.req_id, r.tree.path_log_probs, r.accepted)
                            for r in step.requests if r.proposed and r.accepted])

    def build_cap(self) -> int:
        """How many nodes to build per tree before :meth:`allocate` cuts them: 1.25 × the
        largest budget of the last allocation, twice it when the next allocation may be a
        doubling probe (at least 8, at most ``max_budget``). A budget can grow by a quarter from
        one step to the next (8 → 64 in 9 steps) without building ``B_max`` nodes for every
        request each step: the heap's pops and the top-k rows cost per node built, not per node
        verified. Exact at any cap: the first ``b`` nodes of the best-first pop order form a
        best-first tree of ``b`` nodes (with log-probs tied exactly at the ``K``-th place,
        ``torch.topk`` picks which tied token it holds, as for any build)."""
        last = max(self.stats.last_budgets, default=self.max_budget)
        return self._cap(last, bool(self._probe_up(self.stats.steps + 1)))

    def _cap(self, last: int, double: bool) -> int:
        """Build cap after a budget of ``last``: 2 × it before a doubling probe, else 1.25 ×,
        within ``[8, max_budget]``. A tree of ``b`` nodes reads the top-``b`` tokens of its
        first ``min(L, b)`` depths, so the cap sets the build's cost: at batch 8 on the shipped
        pair (budgets 6–8) caps of 1.5 × (9–12) cost 1.25 ms a step against 0.91 at 8
        (``build_draft_trees`` on ``[8, 16, 4096]``)."""
        grow = 2 * last if double else -(-5 * last // 4)
        return min(self.max_budget, max(8, grow))

    def build_caps(self, req_ids: Sequence[str]) -> list[int]:
        """:meth:`build_cap` per request, from each request's own last budget (a request without
        one gets :meth:`build_cap`): at batch 8 a batch-wide cap built every tree at 1.5 × the
        largest budget of the batch, twice the nodes the step's heaps needed (measured on the
        shipped pair, batch 8, profiled: tree build 1.61 ms a step against 0.81 for B = 8).

        Args:
            req_ids: the requests of this step's drafter batch, in row order.

        Returns:
            one cap per request, each in ``[min(8, max_budget), max_budget]``.
        """
        double = self._probe_up(self.stats.steps + 1)
        fallback = None
        caps = []
        for r in req_ids:
            last = self._last_budget.get(r)
            if last is None:
                fallback = self.build_cap() if fallback is None else fallback
                caps.append(fallback)
                continue
            caps.append(self._cap(last, bool(double)))
        return caps

    def _probe_up(self, step: int) -> bool | None:
        """Allocation ``step`` (1-based) may be a probe: False halving, True doubling (they
        alternate every ``probe_every`` steps, halving first: a new engine starts at
        ``B_max``-node trees, its prior slope being 0, where a doubling probe cannot grow);
        None: not a probe step."""
        if not self.probe_every or step % self.probe_every:
            return None
        return (step // self.probe_every) % 2 == 0

    def observe_drafter(self, seconds: float) -> None:
        """Record one step's drafting wall time (seconds > 0: the drafter pass and the tree
        build), a part of every speculative step that target-only decoding does not pay; kept
        as a moving average (weight 0.1)."""
        s = _check_pos_float("seconds", seconds)
        self.drafter_seconds = s if self.drafter_seconds == 0.0 else (
            0.9 * self.drafter_seconds + 0.1 * s)

    def observe_step(self, tokens: int, seconds: float, requests: int = 1) -> None:
        """Record one step's verified rows, wall time and requests served (see
        :meth:`StepCostModel.observe`)."""
        self.cost.observe(tokens, seconds, requests)

    def size_trees(self, req_ids: Sequence[str], trees: Sequence[Any],
                   token_budget: int | None = None,
                   remaining_tokens: Sequence[int] | None = None) -> list[Any]:
        """:meth:`allocate` for one step's trees, each cut to its budget.

        The trees were built at :meth:`build_caps` nodes; a prefix of the best-first pop order is
        the best-first tree of that size (parents are popped before children), so only the size
        changes and the step stays exact.

        Args:
            req_ids: the requests, in batch order.
            trees: one :class:`~vllm_ddtree.tree.DraftTree` per request.
            token_budget: rows one step may verify (``max_num_batched_tokens``); below two rows
                per request the scheduler decides who waits, so it is then ignored.
            remaining_tokens: as in :meth:`allocate`.

        Returns:
            the cut trees, in order.
        """
        from vllm_ddtree.step import truncate_tree

        cap = token_budget if token_budget is not None and token_budget >= 2 * len(req_ids) \
            else None
        budgets = self.allocate(req_ids, [t.path_log_probs for t in trees], token_budget=cap,
                                remaining_tokens=remaining_tokens)
        return [truncate_tree(t, b) for t, b in zip(trees, budgets)]

    def step_finished(self, step_index: int | None, rows: int, requests: int,
                      now: float) -> None:
        """Feed the cost model at the end of one engine step's drafting: the time since the
        previous call is one engine step (scheduling, the target forward of the ``rows`` it
        verified, the drafter) when the two calls belong to consecutive steps (an idle engine in
        between is not cost) and the step was decode-only (``rows > 0``; the caller passes 0 for
        steps with prefill chunks, which cost far less per row than tree nodes). The first step
        of each ``(rows, requests)`` is not observed (its one-time costs are not what the size
        costs from then on); if that step was a probe, the next allocation repeats the probe.

        Args:
            step_index: the runner's count of prepared steps (``None``: unknown, not timed).
            rows: tokens the step verified, or 0.
            requests: requests scheduled in the step.
            now: ``time.perf_counter()`` at the call, s.
        """
        last, self._last_step = self._last_step, (step_index, now)
        if (step_index is not None and last is not None and last[0] is not None
                and last[0] == step_index - 1 and rows > 0):
            size = (rows, requests)
            if size in self._sizes_seen:
                self.observe_step(rows, now - last[1], requests)
            else:  # a size's first step pays one-time costs (see the class docstring)
                self._sizes_seen.add(size)
                # that step taught the cost model nothing: repeat it if it was a probe
                self._repeat_probe = self._last_probe

    def forget(self, live_req_ids: set[str]) -> None:
        """Drop predictions and last budgets of requests that are gone."""
        for r in [r for r in self._pending if r not in live_req_ids]:
            del self._pending[r]
        for r in [r for r in self._last_budget if r not in live_req_ids]:
            del self._last_budget[r]
