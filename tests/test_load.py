"""Load test (slow): the OpenAI server with DDTree under 32 concurrent clients loses nothing
(issue 15). Runs ``benchmarks/load.py`` against target-only, vLLM's DFlash chain and DDTree on
the trained pair: mixed prompt lengths (shared prefixes, prompts near ``max_model_len``),
streaming and not, ``n = 2``, seeds, clients dropping streams, refused requests. Checked by
``run``: healthy after every round, running requests and KV usage back to 0, resident memory not
growing across rounds, every greedy completion equal to target-only's, every refused request a
4xx naming the option."""

from __future__ import annotations

import importlib.util

import pytest

from tests.support.server import ROOT_DIR


@pytest.mark.slow
def test_load_loses_nothing(tmp_path):
    spec = importlib.util.spec_from_file_location("load", ROOT_DIR / "benchmarks" / "load.py")
    load = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(load)
    report = load.run(clients=32, seconds=20, rounds=3, work=tmp_path)
    print(report)
    assert report["failures"] == []
    for name in ("target-only", "dflash", "ddtree"):
        assert report[name]["by_kind"]["drop"] > 0 and report[name]["by_kind"]["refused"] > 0
