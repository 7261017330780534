"""The training and evaluation text: Python standard-library sources of the running interpreter.

Every machine with Python has them offline. The split is by module (file):

* **train**: every ``*.py`` under ``os.path.dirname(os.__file__)`` except test suites
  (``test/``, ``tests/``, ``idle_test/``), installed packages (``site-packages``) and
  :data:`HELD_OUT`. The tokenizer and the target are trained on it.
* **held out**: the modules in :data:`HELD_OUT`. Never trained on; evaluation prompts
  (:func:`eval_prompts`) are cut from them.
* **unseen**: the standard library's test suites (``test/`` etc.): never seen by the target, used
  only as extra *distillation prompts* for the drafter (code the target never saw).

Files are read sorted by path, so the corpus is deterministic for a given Python installation
(another Python version gives a slightly different corpus and therefore different weights).
"""

from __future__ import annotations

import glob
import os

#: Modules held out of all training (target, tokenizer and drafter): evaluation prompts come from here.
HELD_OUT = (
    "bisect.py", "calendar.py", "colorsys.py", "difflib.py", "fileinput.py", "fractions.py",
    "graphlib.py", "heapq.py", "netrc.py", "queue.py", "sched.py", "shlex.py", "statistics.py",
    "textwrap.py",
)
_TEST_DIRS = ("/test/", "/tests/", "/idle_test/")
_SKIP_DIRS = ("/site-packages/", "/dist-packages/", "/__pycache__/")


def stdlib_root() -> str:
    return os.path.dirname(os.__file__)


def _all_files() -> list[str]:
    root = stdlib_root()
    files = sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True))
    return [f for f in files if not any(s in f for s in _SKIP_DIRS)]


def _is_held_out(path: str) -> bool:
    return os.path.dirname(path) == stdlib_root() and os.path.basename(path) in HELD_OUT


def train_files() -> list[str]:
    """Paths of the training modules (sorted)."""
    return [f for f in _all_files() if not _is_held_out(f) and not any(s in f for s in _TEST_DIRS)]


def held_out_files() -> list[str]:
    """Paths of the held-out modules (sorted)."""
    return [f for f in _all_files() if _is_held_out(f)]


def unseen_files() -> list[str]:
    """Paths of the test-suite files (never seen by the target; drafter distillation prompts only)."""
    return [f for f in _all_files() if any(s in f for s in _TEST_DIRS)]


def read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as fh:
        return fh.read()


def eval_prompts(num: int = 8, lines: int = 12) -> list[str]:
    """``num`` prompts of ``lines`` source lines from the held-out modules, round-robin by module.

    A prompt starts at a ``def`` line (top level or method) and ends after ``lines`` lines, so
    the model continues real code mid-function. Deterministic: the k-th ``def`` of each module in
    turn, skipping the first few of each file (module docstrings and imports are less typical).
    """
    per_module: list[list[str]] = []
    for path in held_out_files():
        src = read(path).splitlines(keepends=True)
        starts = [i for i, line in enumerate(src) if line.lstrip().startswith("def ")]
        chunks = ["".join(src[i:i + lines]) for i in starts[2::3] if i + lines <= len(src)]
        if chunks:
            per_module.append(chunks)
    prompts: list[str] = []
    k = 0
    while len(prompts) < num and any(k < len(c) for c in per_module):
        prompts.extend(c[k] for c in per_module if k < len(c))
        k += 1
    return prompts[:num]


if __name__ == "__main__":  # write the held-out evaluation prompts shipped with the trained pair
    import argparse
    import json

    ap = argparse.ArgumentParser(description="write held-out evaluation prompts as JSON")
    ap.add_argument("--out", required=True)
    ap.add_argument("--num", type=int, default=16)
    a = ap.parse_args()
    with open(a.out, "w", encoding="utf-8") as fh:
        json.dump({"source": "held-out stdlib modules: " + ", ".join(HELD_OUT), "prompts": eval_prompts(a.num)},
                  fh, indent=1)
        fh.write("\n")
