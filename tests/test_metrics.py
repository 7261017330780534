"""Tree metrics (``vllm_ddtree/metrics.py``) on synthetic steps: per-depth counters sized by L,
the accepted-depth histogram they imply, the log line with τ."""

from __future__ import annotations

import logging
from types import SimpleNamespace

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
