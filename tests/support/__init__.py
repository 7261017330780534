"""Test-only support code (not part of the ``vllm_ddtree`` wheel)."""
