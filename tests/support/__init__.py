"""Test-only support code, imported as ``tests.support`` (not part of the ``vllm_ddtree`` wheel).

* :mod:`.models`, :mod:`.hybrid_models`, :mod:`.unknown_recurrent`: tiny random-weight models and
  ``vllm.LLM`` settings for CPU tests; :mod:`.trained`: the trained pair in ``models/``;
* :mod:`.oracle_drafts`: drafts from the target's own continuation, wrapped around the V1
  proposer's / V2 speculator's ``build_trees``, in this process or in spawned workers;
  :mod:`.recorder`: every verified V1 step, by wrapping verification and commit;
* :mod:`.triton_cpu`: the CUDA tree-attention backend inside a CPU engine; :mod:`.v2_cpu`: Model
  Runner V2 on CPU; :mod:`.ray_cpu`: vLLM's Ray executor on CPU;
* ``site/sitecustomize.py``: installs those hooks in every process started with it on
  ``PYTHONPATH``; :mod:`.import_hooks`: run a function right after a module is imported.

The plugin never imports anything from here; importing this package does not import vLLM.
"""
