"""Fine-tuning jobs of `symbiont serve`: the durable store under `--jobs-dir`, tenants and
their limits, checks of uploads and requests, the worker thread that trains through the
serving engine's base executor (inference first), token-level windowed steps, and the
co-serving scheduler that fits them into engine iterations (`--slo-tpot-ms`). The HTTP
routes are in `symbiont/serve/http/jobs.py`; docs/jobs.md describes the whole.

Names load on first use."""

from symbiont.util.lazy import lazy_exports

_EXPORTS = {
    **dict.fromkeys(["FileRecord", "JobRecord", "JobStore"], "symbiont.jobs.store"),
    **dict.fromkeys(
        ["JobSpec", "JobsError", "job_spec", "parse_training_file"], "symbiont.jobs.validation"
    ),
    **dict.fromkeys(
        ["RateLimiter", "Tenant", "authenticate", "load_tenants"], "symbiont.jobs.tenants"
    ),
    **dict.fromkeys(["JobRunner", "Worksite", "train_config"], "symbiont.jobs.runner"),
    **dict.fromkeys(
        ["InferenceExecutor", "PriorityGate", "TrainingExecutor"], "symbiont.jobs.priority"
    ),
    "Tokenizing": "symbiont.jobs.examples",
    **dict.fromkeys(["CoServe", "CostModel", "train_coserved"], "symbiont.jobs.coserve"),
    **dict.fromkeys(["WindowedStep", "windowed_backward"], "symbiont.jobs.windows"),
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
