"""The legacy adapter for vLLM's Model Runner V1 (``vllm/v1/worker/gpu_model_runner.py``), for
vLLM 0.32 and 0.33 only: vLLM 0.34 deleted V1, and Model Runner V2 (:mod:`vllm_ddtree.runners.v2`)
is the primary adapter everywhere.

Everything of V1 lives in this package and nowhere else:

* :mod:`.hooks`: the runner patches, i.e. the DDTree step on V1 (lay-out, forward, verification,
  commit, ``auto`` feedback);
* :mod:`.proposer`: ``DDTreeProposer``, built on V1's ``DFlashProposer``;
* :mod:`.verify`: the target's choice at every node through V1's sampler;
* :mod:`.state`: the per-engine state the hooks carry between calls (``runner._ddtree``);
* :mod:`.register`: the register entries of all of the above (absent in 0.34).

Nothing else in the package imports it by name: :func:`vllm_ddtree.integration.legacy_v1` loads
:mod:`.register` and (on vLLM 0.32/0.33 only) :mod:`.hooks`, and returns ``None`` when the
package is gone (the plugin then refuses a vLLM that has V1). **The day 0.32/0.33 support ends,
the change is: delete this package, the tests and benchmark hooks that import it by name (the V1
end-to-end tests), and those two versions from** ``vllm_ddtree.SUPPORTED_VLLM_VERSIONS``
(``tests/test_legacy_v1.py`` deletes the package from a copy and runs the 0.34 checks there).
"""
