"""Stats patches: vLLM's spec-decode counters per tree depth, and the drafter's figures carried
from the worker to the scheduler and Prometheus (:mod:`vllm_ddtree.metrics`)."""

from __future__ import annotations

from typing import Callable

from vllm_ddtree.config import get_ddtree_config
from vllm_ddtree.patches import patch


@patch("vllm.v1.core.sched.scheduler", "Scheduler.make_spec_decoding_stats")
def _make_spec_decoding_stats(original: Callable) -> Callable:
    def make_spec_decoding_stats(self, spec_decoding_stats, num_draft_tokens,
                                 num_accepted_tokens, num_invalid_spec_tokens, request_id):
        ddtree = get_ddtree_config(self.vllm_config)
        if ddtree is None:
            return original(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
                            num_invalid_spec_tokens, request_id)
        if not self.log_stats or not num_draft_tokens:
            # vLLM returns None here, dropping what earlier requests of the step recorded.
            return spec_decoding_stats
        from vllm_ddtree.metrics import carry_figures, observe_tree

        # Per-depth counters sized by L, not vLLM's max(B, L) slots (structured outputs, the
        # only source of invalid drafts, are refused for DDTree).
        stats = observe_tree(spec_decoding_stats, ddtree.drafter_horizon, num_draft_tokens,
                             num_accepted_tokens)
        if spec_decoding_stats is None:  # the step's stats: they carry the worker's figures
            carry_figures(stats, self.__dict__.pop("_ddtree_figures", None))
        return stats

    return make_spec_decoding_stats


@patch("vllm.v1.core.sched.scheduler", "Scheduler.update_from_output")
def _update_from_output(original: Callable) -> Callable:
    def update_from_output(self, scheduler_output, model_runner_output):
        from vllm_ddtree.metrics import OUTPUT_ATTR, merge_figures

        figures = getattr(model_runner_output, OUTPUT_ATTR, None)
        if figures:  # kept until a step's spec-decode stats can carry them to the front end
            self._ddtree_figures = merge_figures(getattr(self, "_ddtree_figures", None), figures)
        return original(self, scheduler_output, model_runner_output)

    return update_from_output


@patch("vllm.v1.worker.gpu_worker", "Worker.sample_tokens")
def _worker_sample_tokens(original: Callable) -> Callable:
    def sample_tokens(self, grammar_output, *args, **kwargs):
        from vllm_ddtree.metrics import attach_figures, worker_figures

        output = original(self, grammar_output, *args, **kwargs)
        figures = worker_figures(self.model_runner)
        return output if figures is None else attach_figures(output, figures)

    return sample_tokens


@patch("vllm.v1.metrics.loggers", "PrometheusStatLogger.__init__")
def _prometheus_stat_logger_init(original: Callable) -> Callable:
    def __init__(self, vllm_config, engine_indexes=None):
        ddtree = get_ddtree_config(vllm_config)
        if ddtree is not None:
            from vllm_ddtree.metrics import HorizonView

            base = type(self)._spec_decoding_cls

            def per_depth(speculative_config, *args, **kwargs):
                return base(HorizonView(speculative_config, ddtree.drafter_horizon),
                            *args, **kwargs)

            # This logger only: vLLM's per-position counters, one per tree depth 1..L.
            self._spec_decoding_cls = per_depth
        original(self, vllm_config, engine_indexes)

    return __init__
