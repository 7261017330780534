"""Metrics for draft trees: per-depth acceptance, τ, and DDTree series in vLLM's ``/metrics``.

vLLM counts speculative decoding as chains (``vllm/v1/spec_decode/metrics.py``): every draft
token is a position, and the per-position counters have ``num_speculative_tokens`` slots —
``K = max(B, L)`` for DDTree, so positions past the drafter horizon L are always 0. For a tree
the draft tokens are **nodes** (B per step, at depths 1..L), and what a step accepts is one
root-to-node **path**. Definitions used here (per verification step = one tree verified for
one request; vLLM calls it a *draft*):

* accepted depth ``a`` (0..L): nodes on the accepted path; the step emits ``a + 1`` tokens
  (the path and the bonus token);
* **τ** (mean acceptance length) ``= 1 + Σa / steps``, vLLM's "Mean acceptance length";
* **per-depth acceptance rate** at depth d (1..L) ``=`` steps whose path reaches depth d
  ``/`` steps (non-increasing in d); it sums to ``τ - 1`` over d;
* node efficiency ``= Σa / nodes verified``: what vLLM prints as "Avg Draft acceptance rate"
  (it is not a per-token acceptance probability for trees).

Where the numbers come from, all through vLLM's own paths:

* engine core: ``Scheduler.make_spec_decoding_stats`` (patched, :func:`observe_tree`) fills
  vLLM's ``SpecDecodingStats`` with per-depth counters sized L;
* front end: vLLM's Prometheus logger keeps its ``vllm:spec_decode_*`` series, with the
  per-position counter sized L for DDTree engines (``PrometheusStatLogger.__init__`` patched,
  :class:`HorizonView`);
* :class:`DDTreeStatLogger`, a ``vllm.stat_logger_plugins`` entry point (vLLM's seam for stat
  loggers, loaded by the OpenAI server's ``AsyncLLM``), adds the ``vllm:ddtree_*`` series below
  (labels ``model_name``, ``engine`` like vLLM's own) and logs τ and the per-depth rates at
  vLLM's stats interval.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase
from vllm.v1.spec_decode.metrics import SpecDecodingStats

from vllm_ddtree.config import get_ddtree_config

logger = logging.getLogger("vllm.ddtree")

#: vLLM's label names for per-engine series (``PrometheusStatLogger``).
LABELS = ["model_name", "engine"]


_WARNED: list[bool] = []


def observe_tree(
    stats: SpecDecodingStats | None, horizon: int, num_nodes: int, accepted_depth: int,
) -> SpecDecodingStats:
    """Add one verified tree to a step's ``SpecDecodingStats`` (created sized ``horizon``).

    Args:
        stats: the step's stats so far, or ``None`` (first request of the step).
        horizon: drafter horizon L: the per-depth counters' length.
        num_nodes: tree nodes verified (vLLM's ``num_draft_tokens``), ≥ 1.
        accepted_depth: nodes on the accepted path, ``0 ≤ a ≤ L``.

    Returns:
        The stats: ``num_drafts`` + 1, ``num_draft_tokens`` + nodes, ``num_accepted_tokens`` + a,
        ``num_accepted_tokens_per_pos[d]`` + 1 for ``d < a`` (the path reaches depth ``d + 1``),
        ``num_draft_tokens_per_pos[d]`` + 1 for ``d < min(nodes, L)`` (depths the tree can
        reach).

    A path deeper than L cannot come from a tree; should one be reported, only its first L
    depths are counted per depth (this runs in the engine's scheduler, where an exception
    would stop the engine), and it is logged once.
    """
    if accepted_depth > horizon and not _WARNED:
        _WARNED.append(True)
        logger.warning("DDTree metrics: accepted depth %d exceeds the drafter horizon L=%d; "
                       "per-depth counters count its first L depths", accepted_depth, horizon)
    if stats is None:
        stats = SpecDecodingStats.new(horizon)
    stats.num_drafts += 1
    stats.num_draft_tokens += num_nodes
    stats.num_accepted_tokens += accepted_depth
    for d in range(min(accepted_depth, horizon)):
        stats.num_accepted_tokens_per_pos[d] += 1
    for d in range(min(num_nodes, horizon)):
        stats.num_draft_tokens_per_pos[d] += 1
    return stats


def accepted_depth_counts(stats: SpecDecodingStats) -> list[int]:
    """``[L + 1]``: how many of the step's trees accepted exactly ``a`` nodes, ``a = 0..L``,
    from the per-depth counters (a path reaching depth d reaches every depth above it)."""
    reach = [stats.num_drafts, *stats.num_accepted_tokens_per_pos, 0]
    return [reach[a] - reach[a + 1] for a in range(len(reach) - 1)]


class HorizonView:
    """A ``SpeculativeConfig`` whose ``num_speculative_tokens`` reads L: handed to vLLM's
    ``SpecDecodingProm`` so its per-position counters have one series per tree depth."""

    def __init__(self, config: Any, horizon: int):
        self._config = config
        self.num_speculative_tokens = horizon

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


_COLLECTORS: dict[str, Any] = {}


def _collector(cls: Any, name: str, doc: str, labelnames: list[str], **kwargs: Any) -> Any:
    """The process's Prometheus collector ``name``, registered if it is not (vLLM unregisters
    every ``vllm:`` collector when it builds its Prometheus logger; engines share one)."""
    try:
        _COLLECTORS[name] = cls(name=name, documentation=doc, labelnames=labelnames, **kwargs)
    except ValueError:  # already registered by another engine's logger in this process
        pass
    return _COLLECTORS[name]


class DDTreeStatLogger(StatLoggerBase):
    """Per-engine DDTree metrics (a ``vllm.stat_logger_plugins`` entry point); does nothing for
    an engine without DDTree.

    Prometheus series (labels ``model_name``, ``engine``; counters get vLLM's ``_total``):

    * ``vllm:ddtree_verification_steps`` — trees verified (τ's denominator);
    * ``vllm:ddtree_tree_nodes`` — tree nodes verified;
    * ``vllm:ddtree_accepted_tokens`` — accepted path nodes (bonus tokens not included);
    * ``vllm:ddtree_accepted_tokens_per_depth`` (label ``depth`` 1..L) — steps whose path
      reaches that depth;
    * ``vllm:ddtree_acceptance_length`` — histogram of tokens emitted per step (``a + 1``,
      buckets 1..L+1);
    * ``vllm:ddtree_node_budget``, ``vllm:ddtree_drafter_horizon`` — gauges, B and L in force.
    """

    def __init__(self, vllm_config: Any, engine_index: int = 0):
        self.config = get_ddtree_config(vllm_config)
        self.engine_index = engine_index
        self.labels = [str(vllm_config.model_config.served_model_name), str(engine_index)]
        self._series: dict[str, Any] | None = None
        self._reset_interval()

    def _reset_interval(self) -> None:
        horizon = self.config.drafter_horizon if self.config else 0
        self._steps = self._nodes = self._accepted = 0
        self._per_depth = [0] * horizon

    def _make_series(self) -> dict[str, Any]:
        import prometheus_client as prom

        horizon, labels = self.config.drafter_horizon, self.labels
        series = {
            name: _collector(prom.Counter, f"vllm:ddtree_{name}", doc, LABELS).labels(*labels)
            for name, doc in (
                ("verification_steps", "DDTree trees verified (one per request and step)."),
                ("tree_nodes", "DDTree tree nodes verified."),
                ("accepted_tokens", "DDTree accepted path nodes (bonus tokens not included)."),
            )
        }
        per_depth = _collector(prom.Counter, "vllm:ddtree_accepted_tokens_per_depth",
                               "DDTree verification steps whose accepted path reaches a depth.",
                               LABELS + ["depth"])
        series["per_depth"] = [per_depth.labels(*labels, str(d + 1)) for d in range(horizon)]
        series["acceptance_length"] = _collector(
            prom.Histogram, "vllm:ddtree_acceptance_length",
            "DDTree tokens emitted per verification step (accepted path + bonus).", LABELS,
            buckets=[float(n) for n in range(1, horizon + 2)]).labels(*labels)
        for name, value in (("node_budget", self.config.budget), ("drafter_horizon", horizon)):
            gauge = _collector(prom.Gauge, f"vllm:ddtree_{name}",
                               f"DDTree {name.replace('_', ' ')} in force.", LABELS)
            gauge.labels(*labels).set(value)
        return series

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        stats = getattr(scheduler_stats, "spec_decoding_stats", None)
        if self.config is None or stats is None:
            return
        if self._series is None:  # after vLLM's Prometheus logger (re)registered its own
            self._series = self._make_series()
        s = self._series
        s["verification_steps"].inc(stats.num_drafts)
        s["tree_nodes"].inc(stats.num_draft_tokens)
        s["accepted_tokens"].inc(stats.num_accepted_tokens)
        for counter, n in zip(s["per_depth"], stats.num_accepted_tokens_per_pos):
            counter.inc(n)
        for depth, count in enumerate(accepted_depth_counts(stats)):
            for _ in range(count):
                s["acceptance_length"].observe(depth + 1)
        self._steps += stats.num_drafts
        self._nodes += stats.num_draft_tokens
        self._accepted += stats.num_accepted_tokens
        self._per_depth = [a + b for a, b in zip(self._per_depth,
                                                 stats.num_accepted_tokens_per_pos)]

    def log(self) -> None:
        """One line per stats interval (vLLM's periodic log): τ and the per-depth rates."""
        if self.config is None or not self._steps:
            return
        steps = self._steps
        logger.info(
            "DDTree metrics (engine %d): mean acceptance length τ %.2f, verification steps %d, "
            "tree nodes per step %.1f (B=%d), per-depth acceptance rate (depth 1..L=%d): %s",
            self.engine_index, 1 + self._accepted / steps, steps, self._nodes / steps,
            self.config.budget, self.config.drafter_horizon,
            ", ".join(f"{n / steps:.3f}" for n in self._per_depth))
        self._reset_interval()

    def log_engine_initialized(self) -> None:
        pass
