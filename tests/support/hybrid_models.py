"""Tiny random-weight Mamba2 hybrid fixtures beyond :mod:`tests.support.models`.

* :func:`build_nemotron_h_target`: ``NemotronHForCausalLM`` (Mamba2 + attention + MLP layers, fp32;
  vLLM ``model_executor/models/nemotron_h.py``). Unlike GraniteMoeHybrid on vLLM 0.32, Nemotron-H
  implements the EAGLE3 aux-hidden-state interface, so vLLM's own ``"dflash"`` method runs on it.
* :func:`nemotron_h_models`: the target and a DFlash drafter for it, built once into a cache
  directory (same cache layout and shared tokenizer as :class:`~tests.support.models.TinyModelZoo`).
* :func:`register_unknown_recurrent_model` / :func:`with_architecture`: a test-only Qwen3-Next
  whose recurrent layers are of a kind the hybrid guard does not know.

Known vLLM 0.32 CPU behaviour: with any speculative method (ngram, dflash) the Nemotron-H greedy
output differs from target-only decoding from the second generated token on, even when nothing is
accepted; compare tree-verifier runs against target-only output. Hybrid + spec decode on CPU also
needs ``enable_prefix_caching=False`` (pass it explicitly: ``models.is_hybrid`` does not list
Nemotron-H).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tests.support.models import (
    TinyModelZoo,
    _install_tokenizer,
    _refill_lm_head,
    _save_hf_model,
    _special_token_ids,
    _torch_dtype,
    build_dflash_drafter,
    cached_build,
)

_LAYER_CHARS = {"M": "Mamba2", "*": "attention", "-": "MLP"}


def build_nemotron_h_target(
    out_dir: str | os.PathLike,
    *,
    hybrid_override_pattern: str = "M-M*M-",
    hidden_size: int = 128,
    intermediate_size: int = 256,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    mamba_num_heads: int = 8,
    mamba_head_dim: int = 32,
    mamba_d_state: int = 16,
    mamba_n_groups: int = 1,
    mamba_chunk_size: int = 64,
    conv_kernel: int = 4,
    vocab_size: int = 2048,
    seed: int = 0,
    dtype: str = "float32",
    initializer_range: float = 0.1,
    lm_head_std: float | None = 0.5,
    max_position_embeddings: int = 8192,
    tokenizer_dir: str | os.PathLike | None = None,
) -> Path:
    """Write a random-weight ``NemotronHForCausalLM`` to ``out_dir`` and return its path.

    Layer ``i`` is ``hybrid_override_pattern[i]``: ``"M"`` a Mamba2 mixer (``mamba_num_heads`` heads of
    ``mamba_head_dim``, state ``mamba_d_state``, ``mamba_n_groups`` groups, causal conv of
    ``conv_kernel``, chunk ``mamba_chunk_size``), ``"*"`` full attention without RoPE (``num_heads`` /
    ``num_kv_heads`` heads of ``head_dim``; the CPU backend accepts 32, 64, 80, ...), ``"-"`` a
    squared-ReLU MLP of ``intermediate_size``. Every layer is pre-RMSNorm + residual. The default,
    ``"M-M*M-"``, has 3 Mamba2, 1 attention and 2 MLP layers (~1.0 M parameters with the 2048-token
    vocab). ``config.json`` carries both ``layers_block_type`` (transformers 5) and
    ``hybrid_override_pattern`` / ``num_hidden_layers`` (read by older loaders and by
    :func:`~tests.support.models.build_dflash_drafter`). Saved in ``dtype`` (fp32 by default:
    the CPU Mamba2 path runs in fp32). Loaded by vLLM ``model_executor/models/nemotron_h.py``.

    Initialisation: transformers' ``_init_weights`` seeded with ``torch.manual_seed(seed)`` (Mamba
    ``A_log``/``dt_bias``/``D`` as in the reference model), then ``lm_head`` redrawn from
    N(0, ``lm_head_std``) (skipped if None). The tokenizer (``tokenizer_dir``, or a freshly trained
    one of ``vocab_size``) is copied in.

    Raises ``ValueError`` on a bad ``dtype``, an empty pattern or one with characters other than
    ``M``, ``*``, ``-``, or no Mamba layer.
    """
    import torch
    from transformers import NemotronHConfig, NemotronHForCausalLM

    _torch_dtype(dtype)
    bad = sorted(set(hybrid_override_pattern) - set(_LAYER_CHARS))
    if not hybrid_override_pattern or bad:
        raise ValueError(f"hybrid_override_pattern must be a non-empty string over 'M*-', got {hybrid_override_pattern!r}")
    if "M" not in hybrid_override_pattern:
        raise ValueError("hybrid_override_pattern needs at least one Mamba2 ('M') layer")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = NemotronHConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        hybrid_override_pattern=hybrid_override_pattern,
        intermediate_size=intermediate_size,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        mamba_num_heads=mamba_num_heads,
        mamba_head_dim=mamba_head_dim,
        ssm_state_size=mamba_d_state,
        n_groups=mamba_n_groups,
        conv_kernel=conv_kernel,
        expand=max(1, (mamba_num_heads * mamba_head_dim) // hidden_size),
        chunk_size=mamba_chunk_size,
        initializer_range=initializer_range,
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=False,
        n_routed_experts=0,
        num_experts_per_tok=1,
        **_special_token_ids(),
    )
    config.architectures = ["NemotronHForCausalLM"]
    torch.manual_seed(seed)
    model = NemotronHForCausalLM(config)
    _refill_lm_head(model, lm_head_std, seed)
    _save_hf_model(model, out, dtype)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["hybrid_override_pattern"] = hybrid_override_pattern
    cfg["num_hidden_layers"] = len(hybrid_override_pattern)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    _install_tokenizer(out, tokenizer_dir, vocab_size)
    return out


def nemotron_h_models(
    cache_root: str | os.PathLike,
    *,
    target_kwargs: dict[str, Any] | None = None,
    drafter_kwargs: dict[str, Any] | None = None,
) -> tuple[Path, Path]:
    """``(target, drafter)``: a Nemotron-H target and its DFlash drafter, cached under ``cache_root``.

    The target is :func:`build_nemotron_h_target` with the zoo's shared tokenizer
    (``TinyModelZoo(cache_root).tokenizer``) and ``target_kwargs``; the drafter is
    :func:`~tests.support.models.build_dflash_drafter` (block_size 16, 1 layer, target layers
    ``default_target_layer_ids(n_layers)``, e.g. ``[0, 4]`` for the 6-layer default) plus
    ``drafter_kwargs``. Both go through :func:`~tests.support.models.cached_build` (directory
    ``nemotron_h_target-<hash>`` / ``nemotron_h_dflash_drafter-<hash>``, rebuilt when arguments or
    ``FORMAT_VERSION`` change).
    """
    root = Path(cache_root)
    tokenizer = TinyModelZoo(root).get("tokenizer")
    target = cached_build(
        root, "nemotron_h_target", build_nemotron_h_target,
        **{"tokenizer_dir": str(tokenizer), **(target_kwargs or {})},
    )
    drafter = cached_build(
        root, "nemotron_h_dflash_drafter", build_dflash_drafter,
        **{"target_dir": str(target), "block_size": 16, **(drafter_kwargs or {})},
    )
    return target, drafter


# ----------------------------------------------------------------------------- guard fixture

#: Architecture name of the test-only model whose recurrent layers the guard does not know.
UNKNOWN_RECURRENT_ARCH = "DDTreeTestUnknownRecurrentForCausalLM"


def register_unknown_recurrent_model() -> None:
    """Register (in this process) a TEST-ONLY Qwen3-Next whose GDN layers are of a class the
    hybrid guard has never seen (a subclass with the same math), to exercise the guard end to end.
    """
    from vllm import ModelRegistry

    from tests.support.unknown_recurrent import UnknownRecurrentForCausalLM

    # The class itself, not a "module:Class" string: vLLM inspects a lazy entry in a fresh
    # subprocess, where tests.support imports only if the working directory is the repo root.
    ModelRegistry.register_model(UNKNOWN_RECURRENT_ARCH, UnknownRecurrentForCausalLM)


def with_architecture(model_dir: str | os.PathLike, out_dir: str | os.PathLike, arch: str) -> Path:
    """A copy of ``model_dir`` (symlinked files) whose ``config.json`` names ``arch``."""
    src, out = Path(model_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "config.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"] = [arch]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
