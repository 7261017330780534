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
* worker: tree-build and KV-compaction times and the ``shadow_linear`` measurement are summed in
  the drafter's :class:`WorkerFigures`, sent with each step's ``ModelRunnerOutput``
  (``Worker.sample_tokens`` patched, :func:`attach_figures`), kept by the scheduler
  (``Scheduler.update_from_output`` patched) and sent on in the step's spec-decode stats, which
  the front end decodes as :class:`DDTreeSpecDecodingStats` (``SchedulerStats``' field type
  widened: vLLM's wire format drops fields its declared type lacks);
* :class:`DDTreeStatLogger`, a ``vllm.stat_logger_plugins`` entry point (vLLM's seam for stat
  loggers, loaded by the OpenAI server's ``AsyncLLM``), adds the ``vllm:ddtree_*`` series below
  (labels ``model_name``, ``engine`` like vLLM's own) and logs τ and the per-depth rates at
  vLLM's stats interval.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Iterator

from vllm.v1.metrics.loggers import StatLoggerBase
from vllm.v1.spec_decode.metrics import SpecDecodingStats

from vllm_ddtree.config import get_ddtree_config

logger = logging.getLogger("vllm.ddtree")

#: vLLM's label names for per-engine series (``PrometheusStatLogger``).
LABELS = ["model_name", "engine"]


_WARNED: list[bool] = []

#: Worker-side figures, summed between two steps' outputs (seconds are host wall time: on CUDA
#: the tree build includes waiting for the drafter's logits, KV compaction only its launches).
WORKER_FIGURES = ("tree_build_seconds", "tree_builds", "kv_compaction_seconds",
                  "kv_compactions", "shadow_steps", "shadow_tree_accepted",
                  "shadow_chain_accepted", "auto_trees", "auto_nodes",
                  "auto_predicted_accepted", "auto_observed_accepted",
                  "auto_chain_fallback_steps", "auto_unprofitable_steps")

#: ``ModelRunnerOutput`` attribute carrying a step's :class:`WorkerFigures` to the scheduler.
OUTPUT_ATTR = "ddtree_figures"


@dataclass
class DDTreeSpecDecodingStats(SpecDecodingStats):
    """vLLM's ``SpecDecodingStats`` plus the worker's figures (:data:`WORKER_FIGURES`, sums since
    the previous stats that carried them).

    Attributes:
        tree_build_seconds: host time building draft trees (best-first, paper §3.2), s.
        tree_builds: tree-building calls (one per engine step with drafts).
        kv_compaction_seconds: host time of KV compaction and the recurrent re-layout, s.
        kv_compactions: commits (one per engine step that verified trees).
        shadow_steps: ``shadow_linear``: trees measured against the realised output.
        shadow_tree_accepted, shadow_chain_accepted: drafts those trees / the verified chains
            accept; the trees' would-be τ is ``1 + shadow_tree_accepted / shadow_steps``.
        auto_trees, auto_nodes: ``ddtree_budget="auto"``: trees sized by the controller and
            the nodes it gave them (mean budget in force = nodes / trees).
        auto_predicted_accepted, auto_observed_accepted: over the verified ones, the drafts
            the calibrated drafter expected to be accepted and those accepted.
        auto_chain_fallback_steps: steps where no tree larger than one node paid.
        auto_unprofitable_steps: steps where target-only decoding was predicted faster.
    """

    tree_build_seconds: float = 0.0
    tree_builds: int = 0
    kv_compaction_seconds: float = 0.0
    kv_compactions: int = 0
    shadow_steps: int = 0
    shadow_tree_accepted: int = 0
    shadow_chain_accepted: int = 0
    auto_trees: int = 0
    auto_nodes: int = 0
    auto_predicted_accepted: float = 0.0
    auto_observed_accepted: int = 0
    auto_chain_fallback_steps: int = 0
    auto_unprofitable_steps: int = 0


#: What the worker sends: :data:`WORKER_FIGURES`, and ``padding_rows``: verified rows past a
#: tree smaller than the ``K`` rows V2 schedules per request, which the scheduler counted as
#: draft tokens (:func:`carry_figures` takes them off).
SENT_FIGURES = (*WORKER_FIGURES, "padding_rows")


class WorkerFigures:
    """One engine's worker-side DDTree figures, summed until the next step's output takes them.

    Owned by the drafter (V1 ``DDTreeProposer``, V2 ``DDTreeSpeculator``) as ``ddtree_figures``.
    """

    def __init__(self) -> None:
        self.pending: dict[str, float] = dict.fromkeys(SENT_FIGURES, 0)

    def add(self, **amounts: float) -> None:
        """Add to figures of :data:`SENT_FIGURES` (``KeyError`` for any other name)."""
        for name, value in amounts.items():
            self.pending[name] += value

    @contextlib.contextmanager
    def timed(self, what: str) -> Iterator[None]:
        """Time the block as ``what`` (``"tree_build"`` or ``"kv_compaction"``): adds its host
        seconds to ``{what}_seconds`` and one to the call count."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            count = "tree_builds" if what == "tree_build" else "kv_compactions"
            self.add(**{f"{what}_seconds": time.perf_counter() - t0, count: 1})

    def drain(self) -> dict[str, float] | None:
        """The figures since the last drain (``None`` if all zero), and start again."""
        if not any(self.pending.values()):
            return None
        out, self.pending = self.pending, dict.fromkeys(SENT_FIGURES, 0)
        return out


def worker_figures(model_runner: Any) -> WorkerFigures | None:
    """The :class:`WorkerFigures` of a worker's model runner (V1: ``drafter``, V2:
    ``speculator``), or ``None`` for an engine without DDTree."""
    for name in ("drafter", "speculator"):
        figures = getattr(getattr(model_runner, name, None), OUTPUT_ATTR, None)
        if isinstance(figures, WorkerFigures):
            return figures
    return None


def attach_figures(output: Any, figures: WorkerFigures) -> Any:
    """Put the figures so far on a step's ``ModelRunnerOutput`` (attribute :data:`OUTPUT_ATTR`);
    for an ``AsyncModelRunnerOutput``, when its ``get_output()`` produces it. Returns ``output``.

    An attribute survives the executors' pickling (multiprocess, Ray) and is ignored by vLLM.
    """
    from vllm.v1.outputs import AsyncModelRunnerOutput

    if isinstance(output, AsyncModelRunnerOutput):
        get_output = output.get_output

        def get_output_with_figures() -> Any:
            return attach_figures(get_output(), figures)

        output.get_output = get_output_with_figures
        return output
    if output is not None:
        output.ddtree_figures = figures.drain()  # OUTPUT_ATTR
    return output


def merge_figures(into: dict[str, float] | None, figures: dict[str, float] | None
                  ) -> dict[str, float] | None:
    """``into + figures`` per name (either may be ``None``)."""
    if not figures:
        return into
    if into is None:
        return dict(figures)
    for name, value in figures.items():
        into[name] = into.get(name, 0) + value
    return into


def carry_figures(stats: SpecDecodingStats, figures: dict[str, float] | None) -> None:
    """Write summed worker figures into a step's :class:`DDTreeSpecDecodingStats` (scheduler
    side), and take V2's padding rows off its draft-token count (the same step's output carries
    them, so the count is the step's tree nodes)."""
    if figures and isinstance(stats, DDTreeSpecDecodingStats):
        fields = vars(stats)  # the plugin's own dataclass
        for name in WORKER_FIGURES:
            fields[name] += figures.get(name, 0)
        stats.num_draft_tokens -= int(figures.get("padding_rows", 0))


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
        stats = DDTreeSpecDecodingStats.new(horizon)
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


#: Worker figure -> (Prometheus counter name after ``vllm:ddtree_``, documentation).
_FIGURE_SERIES = {
    "tree_build_seconds": ("tree_build_seconds", "DDTree host time building draft trees (s)."),
    "tree_builds": ("tree_builds", "DDTree tree-building calls (engine steps with drafts)."),
    "kv_compaction_seconds": ("kv_compaction_seconds",
                              "DDTree host time of KV compaction and recurrent re-layout (s)."),
    "kv_compactions": ("kv_compactions", "DDTree commits (engine steps that verified trees)."),
    "shadow_steps": ("shadow_steps", "DDTree shadow_linear: draft trees measured."),
    "shadow_tree_accepted": ("shadow_tree_accepted_tokens",
                             "DDTree shadow_linear: drafts the unverified trees would accept."),
    "shadow_chain_accepted": ("shadow_chain_accepted_tokens",
                              "DDTree shadow_linear: drafts the verified chains accept, "
                              "measured the same way."),
    "auto_trees": ("auto_trees", "DDTree auto budget: trees sized by the controller."),
    "auto_nodes": ("auto_nodes", "DDTree auto budget: nodes the controller gave those trees."),
    "auto_predicted_accepted": ("auto_predicted_accepted_tokens",
                                "DDTree auto budget: drafts the calibrated drafter expected "
                                "to be accepted (verified trees)."),
    "auto_observed_accepted": ("auto_accepted_tokens",
                               "DDTree auto budget: drafts accepted on the same trees."),
    "auto_chain_fallback_steps": ("auto_chain_fallback_steps",
                                  "DDTree auto budget: steps where no tree larger than one "
                                  "node paid for its verification."),
    "auto_unprofitable_steps": ("auto_unprofitable_steps",
                                "DDTree auto budget: steps where target-only decoding was "
                                "predicted faster than speculation."),
}


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
    * ``vllm:ddtree_node_budget``, ``vllm:ddtree_drafter_horizon`` — gauges, B and L in force;
    * ``vllm:ddtree_tree_build_seconds`` / ``vllm:ddtree_tree_builds`` and
      ``vllm:ddtree_kv_compaction_seconds`` / ``vllm:ddtree_kv_compactions`` — host time and
      calls (mean per engine step = the ratio of their rates);
    * ``vllm:ddtree_shadow_steps``, ``vllm:ddtree_shadow_tree_accepted_tokens``,
      ``vllm:ddtree_shadow_chain_accepted_tokens`` — ``shadow_linear`` only: trees measured and
      the drafts they / the verified chains accept (would-be τ = 1 + tree accepted / steps);
    * ``vllm:ddtree_auto_trees``, ``vllm:ddtree_auto_nodes``,
      ``vllm:ddtree_auto_predicted_accepted_tokens``, ``vllm:ddtree_auto_accepted_tokens``,
      ``vllm:ddtree_auto_chain_fallback_steps``, ``vllm:ddtree_auto_unprofitable_steps`` —
      ``ddtree_budget="auto"`` only: the budget in force (nodes / trees), predicted vs accepted,
      steps that fell back to one-node chains, steps where target-only decoding was predicted
      faster (``vllm:ddtree_node_budget`` is then the cap ``B_max``).
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
        self._figures: dict[str, float] = dict.fromkeys(WORKER_FIGURES, 0)

    def _make_series(self) -> dict[str, Any]:
        import prometheus_client as prom

        horizon, labels = self.config.drafter_horizon, self.labels
        series = {
            name: _collector(prom.Counter, f"vllm:ddtree_{name}", doc, LABELS).labels(*labels)
            for name, doc in (
                ("verification_steps", "DDTree trees verified (one per request and step)."),
                ("tree_nodes", "DDTree tree nodes verified."),
                ("accepted_tokens", "DDTree accepted path nodes (bonus tokens not included)."),
                *_FIGURE_SERIES.values(),
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
        for figure, (series, _) in _FIGURE_SERIES.items():
            value = getattr(stats, figure, 0)  # 0: stats decoded without the widened type
            if value:
                s[series].inc(value)
                self._figures[figure] += value
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
        f = self._figures
        if f["tree_builds"] or f["kv_compactions"]:
            logger.info(
                "DDTree step overhead (engine %d): tree build %.3f ms per step, KV compaction "
                "%.3f ms per step (host time)", self.engine_index,
                1e3 * f["tree_build_seconds"] / max(f["tree_builds"], 1),
                1e3 * f["kv_compaction_seconds"] / max(f["kv_compactions"], 1))
        if f["auto_trees"]:
            logger.info(
                "DDTree auto budget (engine %d): mean node budget %.1f (1..%d), drafts expected "
                "to be accepted %.1f vs accepted %d, one-node chains in %d steps, target-only "
                "predicted faster in %d steps", self.engine_index,
                f["auto_nodes"] / f["auto_trees"], self.config.budget,
                f["auto_predicted_accepted"], f["auto_observed_accepted"],
                f["auto_chain_fallback_steps"], f["auto_unprofitable_steps"])
        if f["shadow_steps"]:
            logger.info(
                "DDTree shadow_linear (engine %d): verified chain τ %.2f; the draft trees would "
                "reach τ %.2f (%d trees measured)", self.engine_index,
                1 + f["shadow_chain_accepted"] / f["shadow_steps"],
                1 + f["shadow_tree_accepted"] / f["shadow_steps"], f["shadow_steps"])
        self._reset_interval()

    def log_engine_initialized(self) -> None:
        pass
