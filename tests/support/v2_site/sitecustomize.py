"""Installs the Model Runner V2 CPU harness (:mod:`tests.support.v2_cpu`) at interpreter start.

Put this directory on ``PYTHONPATH`` (``tests/support/v2_run.py`` does) so that processes vLLM
spawns (tensor-parallel workers, engine cores) choose V2 and see the stand-in Triton backend
before they import vLLM. Python imports ``sitecustomize`` once, from the first match on
``sys.path``.
"""

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[3])
if _ROOT not in sys.path:  # the repo root, so that ``tests.support`` imports
    sys.path.append(_ROOT)

from tests.support.v2_cpu import install  # noqa: E402

install()

from tests.support.oracle_drafts import install_from_env  # noqa: E402

# Test-only oracle drafts in every process of the tree, as tests/support/site does.
install_from_env()
