"""The base process (`symbiont serve-base`): `BaseExecutor` holds the frozen weights once;
`server.py` serves it to many clients (sockets, shared memory, sessions); `scheduler.py`
holds the per-layer queues and batching policies; `stats.py` the live statistics;
`config.py` the frozen configs. Run it with `symbiont serve-base`."""
