"""Tree metrics (``vllm_ddtree/metrics.py``) on synthetic steps: per-depth counters sized by L,
the accepted-depth histogram they imply, the log line with τ."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from vllm_ddtree.config import ADDITIONAL_CONFIG_KEY
from vllm_ddtree.metrics import DDTreeStatLogger, accepted_depth_counts, observe_tree


def test_observe_tree_counts_per_depth_sized_by_horizon():
    stats = None
    for nodes, depth in [(32, 3), (32, 0), (32, 5), (4, 2)]:  # B = 32 > L = 5
        stats = observe_tree(stats, 5, nodes, depth)
    assert stats.num_spec_tokens == 5
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (4, 100, 10)
    assert stats.num_accepted_tokens_per_pos == [3, 3, 2, 1, 1]  # paths reaching depth 1..5
    assert stats.num_draft_tokens_per_pos == [4, 4, 4, 4, 3]
    assert accepted_depth_counts(stats) == [1, 0, 1, 1, 0, 1]  # exactly 0..5 accepted
    tau = 1 + stats.num_accepted_tokens / stats.num_drafts
    assert tau == 1 + sum(stats.num_accepted_tokens_per_pos) / stats.num_drafts == 3.5
    # Never raises (it runs in the engine's scheduler): a too-deep path counts L depths.
    assert observe_tree(None, 5, 32, 6).num_accepted_tokens_per_pos == [1] * 5


def _vllm_config(budget=32, horizon=5):
    ddtree = {"budget": budget, "drafter_horizon": horizon, "drafter": "d"}
    return SimpleNamespace(additional_config={ADDITIONAL_CONFIG_KEY: ddtree},
                           model_config=SimpleNamespace(served_model_name="m"))


def test_stat_logger_logs_tau_per_interval(caplog, monkeypatch):
    import vllm_ddtree.metrics as metrics

    cfg = _vllm_config()
    monkeypatch.setattr(metrics, "get_ddtree_config",
                        lambda c: SimpleNamespace(**c.additional_config[ADDITIONAL_CONFIG_KEY]))
    stats = None
    for depth in (3, 1):
        stats = observe_tree(stats, 5, 32, depth)
    log = DDTreeStatLogger(cfg, engine_index=0)
    log.record(SimpleNamespace(spec_decoding_stats=stats), None)
    with caplog.at_level(logging.INFO, logger="vllm.ddtree"):
        log.log()
        log.log()  # nothing new in the interval: no line
    lines = [r.getMessage() for r in caplog.records if "DDTree metrics" in r.message]
    assert lines == ["DDTree metrics (engine 0): mean acceptance length τ 3.00, verification "
                     "steps 2, tree nodes per step 32.0 (B=32), per-depth acceptance rate "
                     "(depth 1..L=5): 1.000, 0.500, 0.500, 0.000, 0.000"]


def test_stat_logger_is_idle_without_ddtree():
    cfg = SimpleNamespace(additional_config={}, model_config=SimpleNamespace(served_model_name="m"))
    log = DDTreeStatLogger(cfg)
    log.record(SimpleNamespace(spec_decoding_stats=observe_tree(None, 5, 8, 2)), None)
    assert log._series is None
    log.log()


def test_worker_figures_time_sum_and_drain():
    from vllm_ddtree.metrics import WorkerFigures

    figures = WorkerFigures()
    assert figures.drain() is None  # nothing measured: nothing sent
    with figures.timed("tree_build"):
        pass
    with figures.timed("kv_compaction"):
        pass
    figures.add(shadow_steps=2, shadow_tree_accepted=5, padding_rows=3)
    out = figures.drain()
    assert (out["tree_builds"], out["kv_compactions"], out["shadow_steps"]) == (1, 1, 2)
    assert out["tree_build_seconds"] > 0 and out["kv_compaction_seconds"] > 0
    assert figures.drain() is None
    with pytest.raises(KeyError):
        figures.add(no_such_figure=1)


def test_figures_ride_on_the_output_and_through_pickling():
    """Sync and async (``get_output()``) outputs; the executors pickle the output."""
    import pickle

    from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

    from vllm_ddtree.metrics import OUTPUT_ATTR, WorkerFigures, attach_figures

    figures = WorkerFigures()
    figures.add(tree_builds=1)
    out = attach_figures(ModelRunnerOutput(req_ids=[], req_id_to_index={}), figures)
    assert getattr(pickle.loads(pickle.dumps(out)), OUTPUT_ATTR)["tree_builds"] == 1

    class AsyncOutput(AsyncModelRunnerOutput):  # the output is built by get_output()
        sampled_token_ids = None  # V2's AsyncOutput has one too: not a ModelRunnerOutput

        def get_output(self):
            return ModelRunnerOutput(req_ids=[], req_id_to_index={})

    figures.add(kv_compactions=2)
    pending = attach_figures(AsyncOutput(), figures)
    figures.add(kv_compactions=1)  # done before get_output(): still this step's
    assert getattr(pending.get_output(), OUTPUT_ATTR)["kv_compactions"] == 3


def test_scheduler_stats_keep_the_figures_on_vllms_wire():
    """The front end decodes the scheduler's stats with vLLM's msgspec decoder: the widened
    field type keeps the figures (vLLM's own type would drop them), and padding rows come off
    the draft-token count."""
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    import vllm_ddtree.plugin as plugin
    from vllm_ddtree.metrics import DDTreeSpecDecodingStats, carry_figures

    plugin.register()
    stats = observe_tree(None, 5, 16, 3)
    assert isinstance(stats, DDTreeSpecDecodingStats)
    carry_figures(stats, {"tree_build_seconds": 0.25, "tree_builds": 2, "shadow_steps": 4,
                          "padding_rows": 6})
    assert stats.num_draft_tokens == 10
    wire = MsgpackEncoder().encode(EngineCoreOutputs(
        scheduler_stats=SchedulerStats(spec_decoding_stats=stats)))
    got = MsgpackDecoder(EngineCoreOutputs).decode(wire).scheduler_stats.spec_decoding_stats
    assert isinstance(got, DDTreeSpecDecodingStats)
    assert (got.tree_build_seconds, got.tree_builds, got.shadow_steps) == (0.25, 2, 4)
    assert (got.num_drafts, got.num_draft_tokens, got.num_accepted_tokens) == (1, 10, 3)


def test_stat_logger_exports_step_figures_and_shadow_tau(caplog, monkeypatch):
    import vllm_ddtree.metrics as metrics

    cfg = _vllm_config()
    monkeypatch.setattr(metrics, "get_ddtree_config",
                        lambda c: SimpleNamespace(**c.additional_config[ADDITIONAL_CONFIG_KEY]))
    stats = observe_tree(None, 5, 32, 2)
    metrics.carry_figures(stats, {"tree_build_seconds": 0.004, "tree_builds": 2,
                                  "kv_compaction_seconds": 0.001, "kv_compactions": 1,
                                  "shadow_steps": 4, "shadow_tree_accepted": 10,
                                  "shadow_chain_accepted": 6})
    log = DDTreeStatLogger(cfg, engine_index=0)
    log.labels = ["figures-test", "0"]
    log.record(SimpleNamespace(spec_decoding_stats=stats), None)
    import prometheus_client

    value = prometheus_client.REGISTRY.get_sample_value
    labels = {"model_name": "figures-test", "engine": "0"}
    assert value("vllm:ddtree_tree_builds_total", labels) == 2
    assert value("vllm:ddtree_kv_compaction_seconds_total", labels) == 0.001
    assert value("vllm:ddtree_shadow_tree_accepted_tokens_total", labels) == 10
    with caplog.at_level(logging.INFO, logger="vllm.ddtree"):
        log.log()
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "tree build 2.000 ms per step, KV compaction 1.000 ms per step" in text
    assert "verified chain τ 2.50; the draft trees would reach τ 3.50 (4 trees measured)" in text


def test_auto_budget_decisions_reach_the_figures(caplog, monkeypatch):
    """``ddtree_budget="auto"``: the controller's budgets, predictions and fallbacks go to the
    worker figures as increments of its own totals, and out as ``vllm:ddtree_auto_*``."""
    import torch

    import vllm_ddtree.metrics as metrics
    from vllm_ddtree.budget import BudgetController, StepCostModel
    from vllm_ddtree.metrics import WorkerFigures

    figures = WorkerFigures()
    ctl = BudgetController(8, cost=StepCostModel(prior_intercept=0.01), figures=figures)
    paths = [torch.log(torch.tensor([1.0, 0.9, 0.8, 0.5, 0.3, 0.1, 0.05])),
             torch.log(torch.tensor([1.0, 0.6, 0.2, 0.1]))]
    budgets = ctl.allocate(["a", "b"], paths)
    ctl.observe_tree("a", paths[0][: budgets[0] + 1], [0, 1, 2])
    sent = figures.drain()
    assert (sent["auto_trees"], sent["auto_nodes"]) == (ctl.stats.trees, ctl.stats.budget_sum)
    assert sent["auto_predicted_accepted"] == ctl.stats.predicted_accepted > 0
    assert sent["auto_observed_accepted"] == ctl.stats.observed_accepted == 2
    assert sent["auto_chain_fallback_steps"] == ctl.stats.chain_fallback_steps

    cfg = _vllm_config(budget=8)
    monkeypatch.setattr(metrics, "get_ddtree_config",
                        lambda c: SimpleNamespace(**c.additional_config[ADDITIONAL_CONFIG_KEY]))
    stats = observe_tree(None, 5, sum(budgets), 2)
    metrics.carry_figures(stats, sent)
    log = DDTreeStatLogger(cfg, engine_index=0)
    log.labels = ["auto-test", "0"]
    log.record(SimpleNamespace(spec_decoding_stats=stats), None)
    import prometheus_client

    labels = {"model_name": "auto-test", "engine": "0"}
    value = prometheus_client.REGISTRY.get_sample_value
    assert value("vllm:ddtree_auto_nodes_total", labels) == sum(budgets)
    assert value("vllm:ddtree_auto_accepted_tokens_total", labels) == 2
    with caplog.at_level(logging.INFO, logger="vllm.ddtree"):
        log.log()
    assert any(f"mean node budget {sum(budgets) / 2:.1f} (1..8)" in r.getMessage()
               for r in caplog.records)
