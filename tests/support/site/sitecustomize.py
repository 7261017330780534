"""TEST-ONLY start-up hooks for every Python process started with this directory on ``PYTHONPATH``.

Python imports ``sitecustomize`` at interpreter start, so processes that vLLM or Ray spawn
(engine core, ``mp`` tensor-parallel workers, Ray workers) run this before anything else, as
long as they inherit ``PYTHONPATH`` (:func:`tests.support.oracle_drafts.subprocess_env` builds
it). Each hook is switched on by its own environment variable and nothing is imported early
(hooks run once the module they patch is imported, :mod:`tests.support.import_hooks`):

* ``VLLM_DDTREE_TEST_DRAFTS=<file>``: oracle drafts in every DDTree proposer / speculator
  (:func:`tests.support.oracle_drafts.install_from_env`);
* ``VLLM_TEST_RAY_CPU=1``: vLLM's Ray executor on a CPU machine (:mod:`tests.support.ray_cpu`).

Python imports only the first ``sitecustomize`` on ``sys.path``; the next one (another test
site directory, or the environment's own) is run after these hooks, so such directories compose.
"""

import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_ROOT = str(_HERE.parents[2])
if _ROOT not in sys.path:  # the repository root, so that ``tests.support`` imports
    sys.path.append(_ROOT)

if os.environ.get("VLLM_DDTREE_TEST_DRAFTS"):
    from tests.support.oracle_drafts import install_from_env

    install_from_env()

if os.environ.get("VLLM_TEST_RAY_CPU") == "1":
    from tests.support.ray_cpu import install as _install_ray_cpu

    _install_ray_cpu()


def _run_next_sitecustomize() -> None:
    """Run the next ``sitecustomize.py`` on ``sys.path`` after this directory, if any."""
    entries = [str(Path(p or ".").resolve()) for p in sys.path]
    if str(_HERE) not in entries:
        return
    later = sys.path[entries.index(str(_HERE)) + 1 :]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", later)
    if spec is None or spec.origin is None or Path(spec.origin).resolve().parent == _HERE:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


_run_next_sitecustomize()
