"""The trained tiny pair shipped in the repository (``models/``), for the tests and benchmarks.

* :data:`TARGET_DIR`: ``models/pystdlib-qwen3``, a 5.25 M-parameter ``Qwen3ForCausalLM`` (fp32)
  trained on the Python standard library (``examples/train/train_target.py``);
* :data:`DRAFTER_DIR`: ``models/pystdlib-qwen3-dflash``, its DFlash drafter (``DFlashDraftModel``,
  block 16, 2 layers, target layers [1, 3]) distilled from the target's greedy continuations
  (``examples/train/train_drafter.py``);
* :func:`heldout_prompts`: code prompts cut from standard-library modules held out of all training
  (``models/heldout_prompts.json``).

The paths are relative to the source checkout (editable installs); :func:`require` raises a clear
error when the checkpoints are missing (e.g. a non-editable install).
"""

from __future__ import annotations

import json
from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parents[2] / "models"
TARGET_DIR = MODELS_DIR / "pystdlib-qwen3"
DRAFTER_DIR = MODELS_DIR / "pystdlib-qwen3-dflash"
PROMPTS_FILE = MODELS_DIR / "heldout_prompts.json"


def require() -> tuple[Path, Path]:
    """``(TARGET_DIR, DRAFTER_DIR)``; ``FileNotFoundError`` naming what is missing."""
    for path in (TARGET_DIR / "model.safetensors", DRAFTER_DIR / "model.safetensors", PROMPTS_FILE):
        if not path.exists():
            raise FileNotFoundError(f"{path} not found: the trained pair ships in the source checkout's models/")
    return TARGET_DIR, DRAFTER_DIR


def heldout_prompts(num: int | None = None) -> list[str]:
    """The first ``num`` (default all 16) held-out code prompts."""
    prompts = json.loads(PROMPTS_FILE.read_text())["prompts"]
    return prompts[:num] if num is not None else prompts
