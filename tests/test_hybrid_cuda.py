"""Hybrid targets on the CUDA code path: the tree oracle through vLLM's Triton kernels.

No GPU here: the Triton kernels run under Triton's interpreter on CPU tensors.

* GatedDeltaNet: :mod:`vllm_ddtree.hybrid.gdn_cuda` per node against the fp32 references
  (``tests/support/gdn_cuda_check.py``, a subprocess: the interpreter is chosen before Triton
  loads).
* Whole V2 engines (``tests.support.v2_run`` with ``cuda_recurrent``): a Qwen3-Next-like target
  (GDN ``forward_cuda``) and a Nemotron-H-like one (the mixer's Triton conv and Triton SSU
  backend) equal target-only decoding through the same kernels, with drafts that leave the
  top-1 spine; the power checks without the recurrent re-layout must differ. fp32: Triton's
  interpreter corrupts bf16 values in vLLM's conv kernel. Node budgets 7 … 32 (trees of fewer
  and more rows than the drafter horizon) and preemption are slow-marked.
* The guards: vLLM's fused GDN MTP op is never chosen during a DDTree step, and hybrid DDTree
  engines on CUDA run piecewise CUDA graphs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.support.v2_run import V2_RUNNER, run_v2

REPO = Path(__file__).resolve().parents[1]


def test_gdn_cuda_oracle_every_node_equals_its_path_as_a_chain():
    """Conv output and core output of every node of three requests' trees (one a chain;
    shuffled slots; committed slot at num_accepted - 1; fewer state blocks than tree nodes), and
    the state and conv window that committing the node's path leaves, equal the root-to-node
    path run through the fp32 references, with vLLM's Triton kernels doing the work."""
    proc = subprocess.run([sys.executable, str(REPO / "tests/support/gdn_cuda_check.py")],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    err = json.loads(proc.stdout.strip().splitlines()[-1])
    assert err["nodes"] == 20
    assert all(err[k] < 1e-5 for k in ("conv", "out", "state", "window")), err


def test_fused_gdn_mtp_op_is_never_chosen_during_a_ddtree_step():
    """vLLM 0.32/0.33 send speculative GDN rows of <= 8 tokens to a fused CUDA op when
    ``_can_use_fused_gdn_mtp_decode`` says so; during a DDTree step it says no, and plain
    engines keep vLLM's answer."""
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        QwenGatedDeltaNetAttention,
    )

    from vllm_ddtree import patches
    from vllm_ddtree.hybrid.context import HybridTreeContext, hybrid_tree_active

    patches.apply_patches()
    installed = QwenGatedDeltaNetAttention._can_use_fused_gdn_mtp_decode
    assert installed.__code__.co_filename == patches.hybrid._gdn_no_fused_mtp.__code__.co_filename
    wrapper = patches.hybrid._gdn_no_fused_mtp(lambda self, md: True)
    assert wrapper(None, None) is True
    with hybrid_tree_active(HybridTreeContext({})):
        assert wrapper(None, None) is False
    assert wrapper(None, None) is True


@pytest.mark.parametrize("mode,platform,hybrid,expected", [
    ("FULL_AND_PIECEWISE", "cuda", "oracle", "PIECEWISE"),
    ("FULL_DECODE_ONLY", "cuda", "oracle", "PIECEWISE"),
    ("PIECEWISE", "cuda", "oracle", "PIECEWISE"),
    ("NONE", "cuda", "oracle", "NONE"),
    ("FULL_AND_PIECEWISE", "cpu", "oracle", "FULL_AND_PIECEWISE"),
    ("FULL_AND_PIECEWISE", "cuda", "shadow_linear", "FULL_AND_PIECEWISE"),
])
def test_hybrid_ddtree_on_cuda_runs_piecewise_graphs(mode, platform, hybrid, expected):
    from vllm.config.compilation import CUDAGraphMode

    from vllm_ddtree.hybrid.guard import hybrid_cudagraph_mode

    cfg = SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_mode=CUDAGraphMode[mode]))
    changed = hybrid_cudagraph_mode(cfg, hybrid, platform)
    assert cfg.compilation_config.cudagraph_mode == CUDAGraphMode[expected]
    assert changed == (mode != expected)


PROMPTS = ["def main():\n", "import os\nimport sys\n"]
ENGINE = {"max_model_len": 256, "max_num_seqs": 4, "max_num_batched_tokens": 256}
GREEDY = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}


def _target(name, target, sampling=GREEDY, **extra):
    return {"name": name, "target": str(target), "prompts": PROMPTS, "dtype": "float32",
            "sampling": sampling, **ENGINE, **extra}


def _ddtree(name, target, drafter, budget, ref="ref", sampling=GREEDY, **extra):
    return {**_target(name, target, sampling, **extra),
            "speculative_config": {"method": "ddtree", "model": str(drafter),
                                   "ddtree_budget": budget},
            "oracle": {"from": ref, "sidestep": 3}}


def _auto(name, target, drafter, ref="ref", sampling=GREEDY):
    """``ddtree_budget="auto"`` up to 16 nodes under a fixed cost of 10 ms + 0.2 ms per row
    (tests.support.auto_cost): per-request tree sizes, and the rows V2 booked and did not
    verify recorded per step."""
    cfg = _ddtree(name, target, drafter, "auto", ref, sampling)
    cfg["speculative_config"]["ddtree_max_budget"] = 16
    return {**cfg, "fixed_cost": 2e-4, "record_rows": True}


def _runs(configs: list[dict]) -> dict:
    t0 = time.perf_counter()
    out = {c["name"]: c for c in
           run_v2({"cuda_recurrent": True, "configs": configs}, timeout=3000)["configs"]}
    print(f"\nCUDA-path runs: {time.perf_counter() - t0:.0f} s; " + ", ".join(
        f"{n} ({c['build_s']}, {c['generate_s']})" for n, c in out.items()))
    return out


@pytest.fixture(scope="module")
def mamba2_cuda_runs(nemotron_h_pair) -> dict:
    t, d = nemotron_h_pair
    return _runs([_target("ref", t), _ddtree("B7", t, d, 7), _ddtree("B16", t, d, 16),
                  _ddtree("B16-no-relayout", t, d, 16, disable=["recurrent_relayout"]),
                  _auto("auto", t, d)])


def _ok(r: dict) -> dict:
    assert r["error"] is None, f"[{r['name']}] {r['error']}"
    assert r["runners"] == [V2_RUNNER], r["runners"]
    return r


def _equal_with_deep_paths(runs: dict, name: str, ref: str = "ref") -> None:
    """Equal to target-only, with accepted paths of two or more drafts (off the spine)."""
    want, got = _ok(runs[ref]), _ok(runs[name])
    assert got["token_ids"] == want["token_ids"]
    per_pos = got["spec"]["accepted_per_pos"]
    assert len(per_pos) > 1 and per_pos[1] > 0, got["spec"]
    if got["rows"] is not None:  # auto: some step verified fewer rows than V2 booked
        assert any(verified < scheduled for verified, scheduled, _ in got["rows"]), got["rows"]


@pytest.mark.parametrize("name", ["B7", "B16", "auto"])
def test_mamba2_cuda_path_equals_target_only(mamba2_cuda_runs, name):
    """Greedy DDTree on a Nemotron-H-like target through vLLM's Triton conv and SSU kernels
    equals target-only through the same kernels (``auto``: per-request tree sizes, only the
    trees' rows verified)."""
    _equal_with_deep_paths(mamba2_cuda_runs, name)


def test_mamba2_cuda_path_power_check_without_relayout(mamba2_cuda_runs):
    """Without the recurrent re-layout after verification the same run leaves target-only."""
    got = _ok(mamba2_cuda_runs["B16-no-relayout"])
    assert got["token_ids"] != mamba2_cuda_runs["ref"]["token_ids"]


@pytest.fixture(scope="module")
def gdn_cuda_runs(qwen3_next_target, qwen3_next_dflash_drafter) -> dict:
    t, d = qwen3_next_target, qwen3_next_dflash_drafter
    short = {**GREEDY, "max_tokens": 8}
    return _runs([_target("ref", t, short), _ddtree("B9", t, d, 9, sampling=short),
                  _auto("auto", t, d, sampling=short)])


@pytest.mark.parametrize("name", ["B9", "auto"])
def test_gdn_cuda_path_equals_target_only(gdn_cuda_runs, name):
    """Greedy DDTree on a Qwen3-Next-like target through GDN's forward_cuda (vLLM's Triton conv
    and fused GDN update; 9 nodes, fewer than the drafter horizon; ``auto``: per-request tree
    sizes, only the trees' rows verified) equals target-only."""
    _equal_with_deep_paths(gdn_cuda_runs, name)


@pytest.mark.slow
def test_cuda_path_budgets_and_power_check(nemotron_h_pair, qwen3_next_target,
                                          qwen3_next_dflash_drafter):
    """Both layer kinds at node budgets 7, 8, 9, 16, 32 (trees of at most 8 rows and deeper
    ones); GDN without the re-layout must differ. (Preemption of hybrids is tested on the CPU
    path, ``tests/test_hybrid_e2e.py``: a cache small enough to preempt here but large enough
    for ``max(B, L) + 1`` state blocks per request was not found in the time interpreted
    kernels allow.)"""
    qt, qd = qwen3_next_target, qwen3_next_dflash_drafter
    nt, nd = nemotron_h_pair
    configs = [_target("q-ref", qt)] + [
        _ddtree(f"q-B{b}", qt, qd, b, "q-ref") for b in (7, 8, 16, 32)] + [
        _ddtree("q-B16-no-relayout", qt, qd, 16, "q-ref", disable=["recurrent_relayout"]),
        _target("n-ref", nt)] + [_ddtree(f"n-B{b}", nt, nd, b, "n-ref") for b in (8, 9, 32)]
    out = _runs(configs)
    for b in (7, 8, 16, 32):
        _equal_with_deep_paths(out, f"q-B{b}", "q-ref")
    for b in (8, 9, 32):
        _equal_with_deep_paths(out, f"n-B{b}", "n-ref")
    assert _ok(out["q-B16-no-relayout"])["token_ids"] != out["q-ref"]["token_ids"]
