"""What clients and the base executor agree on: the `Executor` interface, its `Op`s and
`Manifest`, experts calls' checks and layout (`experts.py`), the typed messages of the wire protocol and their msgpack codec, the
shared-memory segment layout, and endpoint URLs. Imports only `symbiont.model`."""
