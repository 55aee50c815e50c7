"""The HTTP layer of `symbiont serve`: `api.py` (the FastAPI app, OpenAI-compatible),
`protocol.py` (request and response schemas), `metrics.py` (Prometheus), `server.py`
(`ServerConfig`, `load_engine`, `run`, `BackgroundServer`)."""
