"""DFlash drafters mixing sliding-window and full attention (Model Runner V2 only in vLLM 0.32).

vLLM resolves each DFlash draft layer's attention in ``vllm/model_executor/models/qwen3_dflash.py``
``_resolve_layer_attention``: ``layer_types[i] == "sliding_attention"`` makes layer ``i`` a
sliding-window layer with the window ``dflash_config.swa_window_size`` (else the top-level
``sliding_window``), causal unless ``dflash_config.causal`` says otherwise (``_dflash_layer_causal``);
full layers stay non-causal. A ``layer_types`` that mixes both kinds needs one KV-cache group per
kind for the drafter, which only Model Runner V2 has: ``VllmConfig`` refuses it on V1 ("Model
Runner V1 does not support: mixed sliding/full dflash drafts").

* :func:`build_sliding_dflash_drafter`: random weights, 2 layers, for the tiny ``qwen3_target``
  (acceptance about zero: only rejections are exercised).
* :func:`make_sliding_variant`: the same attention layout put onto an existing drafter, e.g. the
  shipped trained one (``tests.support.trained``), so drafts are accepted; its weights were
  trained with full attention, which lowers but does not remove acceptance.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from tests.support.models import TinyModelZoo, build_dflash_drafter, cached_build

#: Layer types of the mixed drafters: layer 0 sliding, layer 1 full.
MIXED_LAYER_TYPES = ("sliding_attention", "full_attention")
_KINDS = ("sliding_attention", "full_attention")


def _set_layer_types(config_path: Path, layer_types: list[str], window: int) -> None:
    cfg = json.loads(config_path.read_text())
    if len(layer_types) != cfg["num_hidden_layers"]:
        raise ValueError(f"{len(layer_types)} layer types for {cfg['num_hidden_layers']} drafter layers")
    cfg["layer_types"] = list(layer_types)
    cfg["dflash_config"] = {**cfg["dflash_config"], "swa_window_size": window}
    config_path.write_text(json.dumps(cfg, indent=2, sort_keys=True))


def _check(layer_types, window: int) -> list[str]:
    types = list(layer_types)
    if any(t not in _KINDS for t in types) or window < 1:
        raise ValueError(f"layer types must be in {_KINDS} and window >= 1, got {types}, window={window}")
    return types


def build_sliding_dflash_drafter(
    out_dir: str | os.PathLike,
    target_dir: str | os.PathLike,
    *,
    layer_types: tuple[str, ...] | list[str] = MIXED_LAYER_TYPES,
    window: int = 8,
    block_size: int = 16,
    seed: int = 0,
) -> Path:
    """Write a random-weight DFlash drafter with one layer per ``layer_types`` entry; return its path.

    Built by :func:`tests.support.models.build_dflash_drafter` (``num_layers =
    len(layer_types)``; for the 4-layer tiny target, target layers [0, 2]), then ``config.json``
    gets ``layer_types`` and ``dflash_config.swa_window_size = window`` (context positions a
    sliding layer attends to).

    Raises ``ValueError`` for an unknown layer type or ``window`` < 1.
    """
    types = _check(layer_types, window)
    out = build_dflash_drafter(out_dir, target_dir, block_size=block_size, num_layers=len(types), seed=seed)
    _set_layer_types(out / "config.json", types, window)
    return out


def make_sliding_variant(
    drafter_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    layer_types: tuple[str, ...] | list[str] = MIXED_LAYER_TYPES,
    window: int = 8,
) -> Path:
    """Copy the DFlash drafter at ``drafter_dir`` to ``out_dir`` with ``layer_types`` and
    ``dflash_config.swa_window_size = window`` in its ``config.json``; return ``Path(out_dir)``.

    Weights are unchanged (symlinked). Raises ``ValueError`` for an unknown layer type,
    ``window`` < 1, or a number of layer types other than the drafter's layer count.
    """
    types = _check(layer_types, window)
    src, out = Path(drafter_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.name == "config.json" or not item.is_file():
            continue
        if item.suffix == ".safetensors":
            (out / item.name).unlink(missing_ok=True)
            (out / item.name).symlink_to(item.resolve())
        else:
            shutil.copy2(item, out / item.name)
    shutil.copy2(src / "config.json", out / "config.json")
    _set_layer_types(out / "config.json", types, window)
    return out


def sliding_dflash_drafter(zoo: TinyModelZoo, *, window: int = 8,
                           layer_types: tuple[str, ...] = MIXED_LAYER_TYPES) -> Path:
    """The random mixed sliding/full drafter for the zoo's ``qwen3_target``, built once into its cache."""
    return cached_build(zoo.cache_root, "sliding_dflash_drafter", build_sliding_dflash_drafter,
                        target_dir=str(zoo.get("qwen3_target")), layer_types=list(layer_types),
                        window=window)
