"""Tree attention for the target's verification pass: every tree node attends to the committed
prefix plus its own ancestors and itself (DDTree paper §3, ancestor-only mask).

vLLM removed its TREE_ATTN backend (PR #42121); this package restores tree attention as plugin
backends: ``cpu`` overrides vLLM's ``CPU_ATTN`` (the only backend the CPU platform selects).
The per-step trees reach the backends through :mod:`vllm_ddtree.attention.common`.
"""
