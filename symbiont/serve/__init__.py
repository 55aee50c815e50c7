"""Multi-tenant serving: many adapters in one continuous batch behind an OpenAI-compatible API.

Map of this package (see docs/serving.md):

- `engine.py`       Engine: the thin coordinator of one iteration (schedule, run, sample, output).
- `scheduler.py`    iteration-level scheduling with chunked prefill and KV reservation.
- `model_runner.py` flattens the scheduled tokens into one forward and returns the logits.
- `output.py`       the stop rule and incremental text per sequence -> request outputs.
- `sequence.py`     Request, Sequence, outputs (SamplingParams from `symbiont.decoding`).
- `kv_cache.py`     paged KV cache: blocks shared by all sequences, one block table each.
- `attention.py`    attention over flattened tokens of many sequences (AttentionInterface).
- `adapters.py`     PEFT folders -> slots of stacked weights; grouped per-token apply.
- `weight_methods.py` AdaLoRA, VeRA, LoHa, LoKr, DoRA rewritten as LoRA slots or row terms.
- `virtual_tokens.py` prompt, P- and prefix tuning: positions before each request's prompt.
- `context.py`      the per-iteration StepContext layers read.
- `async_engine.py` the engine on its own thread, with asyncio streams for the API.
- `http/`           the FastAPI app, OpenAI schemas, Prometheus metrics, the uvicorn runner.
"""

from symbiont.util.lazy import lazy_exports

# Names load on first use: `symbiont serve --help` reads only serve/config.py.
_EXPORTS = {
    **dict.fromkeys(
        ["FinishReason", "InvalidSamplingParams", "SamplingParams"], "symbiont.decoding"
    ),
    **dict.fromkeys(["AdapterError", "AdapterNotFound"], "symbiont.serve.adapters"),
    "EngineConfig": "symbiont.serve.config",
    **dict.fromkeys(["Engine", "RequestError"], "symbiont.serve.engine"),
    "QueueFull": "symbiont.serve.scheduler",
    **dict.fromkeys(["Request", "RequestOutput"], "symbiont.serve.sequence"),
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
