"""The client side: an ordinary HF model whose frozen linear layers run on an executor.

`loader.py` builds it (`load_client`), `virt.py` holds the VirtLayers, `experts.py` the
VirtExperts of mixture-of-experts models, `remote.py` reaches
a `serve-base` process (`connect`), `fusion.py` fuses forward calls that
share an input into one round trip, `masking.py` hides activations from executors
(`mask_activations`, docs/privacy.md).
"""
