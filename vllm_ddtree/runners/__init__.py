"""One thin adapter per vLLM model runner.

* Model Runner V2 (vLLM's default wherever Triton runs, every CUDA GPU): :mod:`.v2`.
* The V1 runner (``vllm/v1/worker/gpu_model_runner.py``; CPU without triton-cpu, or
  ``VLLM_USE_V2_MODEL_RUNNER=0``): its hooks are in :mod:`vllm_ddtree.patches`.

vLLM chooses the runner; the plugin follows it.
"""
