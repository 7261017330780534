"""TEST-ONLY: let vLLM 0.32's Ray executor place workers on a CPU-only machine.

vLLM's CPU platform has an empty ``ray_device_key``, so its Ray executor refuses to start
("current platform cpu does not support ray", ``vllm/v1/executor/ray_utils.py``). :func:`install`
sets ``CpuPlatform.ray_device_key = "GPU"`` right after ``vllm.platforms.cpu`` is imported. It runs
in every Python process that has ``tests/support/site`` on ``PYTHONPATH`` and
``VLLM_TEST_RAY_CPU=1`` (Ray's own processes and every Ray worker inherit both; see
``site/sitecustomize.py``). Ray is then started with ``RAY_OVERRIDE_RESOURCES='{"GPU": N}'``: N
logical slots that only label one vLLM worker each; torch still runs on the CPU (the
``CUDA_VISIBLE_DEVICES`` Ray sets is ignored).

A ``vllm.general_plugins`` hook would be too late: the Ray worker asks for its device ids
(``ray_executor_v2.py``) before vLLM loads plugins in that process. Never use this outside tests.
"""

from __future__ import annotations

from types import ModuleType

from tests.support.import_hooks import after_import

#: Environment switch read by ``tests/support/site/sitecustomize.py``.
RAY_CPU_ENV = "VLLM_TEST_RAY_CPU"


def _label_cpu_workers(module: ModuleType) -> None:
    module.CpuPlatform.ray_device_key = "GPU"


def install() -> None:
    """Patch ``vllm.platforms.cpu.CpuPlatform`` once it is imported (now, if it already is)."""
    after_import("vllm.platforms.cpu", _label_cpu_workers)
