"""The hybrid-target benchmark scripts: ``gpu_hybrid_oracle.py`` (its bundle and its CPU smoke
mode) and ``hybrid_state_memory.py`` (the numbers of ``docs/hybrid_state_memory.md``)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ORACLE = ROOT / "benchmarks" / "gpu_hybrid_oracle.py"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_state_memory_formula_and_doc_table_agree():
    mem = _load("hybrid_state_memory")
    q = mem.qwen36_27b()
    assert (q.layers, q.conv_dim, q.state_elems) == (48, 10240, 48 * 128 * 128)
    # K = 16: 17 blocks per layer, each a [10240, 3 + 16] bf16 window + a fp32 state
    assert mem.vllm_layout_bytes(q, 16, 4) == 48 * 17 * (10240 * 19 * 2 + 786432 * 4)
    table = mem.tables(40.0, 16)
    doc = (ROOT / "docs" / "hybrid_state_memory.md").read_text()
    for cell in ("2.69 GiB | 14", "13.13 GiB | 3", "97.08 GiB | 0", "54.56 GiB | 0",
                 "162 MiB | 253"):
        assert cell in table and cell in doc, cell


def _vllm_available() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("vllm", "triton"))


@pytest.mark.skipif(not _vllm_available(), reason="needs vLLM (to bundle) and triton")
def test_bundle_holds_the_kernel_files(tmp_path):
    out = tmp_path / "kernels"
    proc = subprocess.run([sys.executable, str(ORACLE), "--bundle", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rel in ("vllm/third_party/flash_linear_attention/ops/fused_sigmoid_gating.py",
                "vllm/model_executor/layers/mamba/ops/causal_conv1d.py",
                "vllm/model_executor/layers/mamba/ops/mamba_ssm.py",
                "vllm/model_executor/layers/mamba/ops/triton_helpers.py"):
        assert (out / rel).is_file(), rel
    # plain file names only (vLLM's tuned-config names hold ',', '=', '(': packed into a JSON)
    assert not [p for p in out.rglob("*") if any(c in p.name for c in ",=()")]


@pytest.mark.slow
@pytest.mark.skipif(not _vllm_available(), reason="needs vLLM (to bundle) and triton")
def test_smoke_mode_passes(tmp_path):
    """``--smoke`` under Triton's interpreter, from a bundle, with stubbed vLLM helpers."""
    out = tmp_path / "kernels"
    subprocess.run([sys.executable, str(ORACLE), "--bundle", str(out)], check=True,
                   capture_output=True, timeout=300, cwd=ROOT)
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(ORACLE), "--smoke", "--vllm-src", str(out)],
                          env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "all required checks passed" in proc.stdout and "| tree / chain |" in proc.stdout
