"""Multi-tenant serving: many adapters in one continuous batch behind an OpenAI-compatible API.

Map of this package (see docs/serving.md):

- `engine.py`     Engine: the iteration loop (schedule, flatten, one forward, sample).
- `scheduler.py`  iteration-level scheduling with chunked prefill and KV reservation.
- `kv_cache.py`   paged KV cache: blocks shared by all sequences, one block table each.
- `attention.py`  attention over flattened tokens of many sequences (AttentionInterface).
- `adapters.py`   PEFT LoRA/IA3 folders -> slots of stacked weights; grouped per-token apply.
- `context.py`    the per-iteration StepContext layers read.
- `async_engine.py` the engine on its own thread, with asyncio streams for the API.
- `api.py`, `protocol.py`, `metrics.py`  the FastAPI app, OpenAI schemas, Prometheus metrics.
"""

from symbiont.serve.adapters import AdapterError, AdapterNotFound
from symbiont.serve.config import EngineConfig
from symbiont.serve.engine import Engine, RequestError
from symbiont.serve.scheduler import QueueFull
from symbiont.serve.sequence import FinishReason, Request, RequestOutput, SamplingParams

__all__ = [
    "AdapterError",
    "AdapterNotFound",
    "Engine",
    "EngineConfig",
    "FinishReason",
    "QueueFull",
    "Request",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
]
