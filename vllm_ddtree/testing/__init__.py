"""Test support for vllm-ddtree: tiny random-weight model builders (:mod:`.models`).

Nothing here is imported by the plugin itself; importing this package does not import vLLM.
"""
