"""TEST-ONLY: let vLLM 0.32's Ray executor place workers on a CPU-only machine.

vLLM's CPU platform has an empty ``ray_device_key``, so its Ray executor refuses to start
("current platform cpu does not support ray", ``vllm/v1/executor/ray_utils.py``). This module is
picked up by every Python process that has this directory on ``PYTHONPATH`` (Ray's own processes
and every Ray worker inherit it) and, only when ``VLLM_TEST_RAY_CPU=1``, sets
``CpuPlatform.ray_device_key = "GPU"`` right after ``vllm.platforms.cpu`` is imported. Ray is then
started with ``RAY_OVERRIDE_RESOURCES='{"GPU": N}'``: N logical slots that only label one vLLM
worker each; torch still runs on the CPU (the ``CUDA_VISIBLE_DEVICES`` Ray sets is ignored).

A ``vllm.general_plugins`` hook would be too late: the Ray worker asks for its device ids
(``ray_executor_v2.py``) before vLLM loads plugins in that process. Never use this outside tests.
"""

import os
import sys

if os.environ.get("VLLM_TEST_RAY_CPU") == "1":
    import importlib.abc
    import importlib.machinery

    _TARGET = "vllm.platforms.cpu"

    def _patch(module) -> None:
        module.CpuPlatform.ray_device_key = "GPU"

    class _PatchOnImport(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != _TARGET:
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                return spec
            exec_module = spec.loader.exec_module

            def exec_and_patch(module, _exec=exec_module):
                _exec(module)
                _patch(module)

            spec.loader.exec_module = exec_and_patch
            return spec

    if _TARGET in sys.modules:
        _patch(sys.modules[_TARGET])
    else:
        sys.meta_path.insert(0, _PatchOnImport())
