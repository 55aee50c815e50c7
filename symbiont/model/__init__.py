"""What a checkpoint holds and which of its modules are frozen base layers.

`checkpoint.py` reads local checkpoint folders tensor by tensor; `skeleton.py` builds the
Hugging Face model on the meta device; `layers.py` says which modules are base layers and
holds their exact math; `moe.py` finds mixture-of-experts stacks (the executor runs
them); `default.py` builds the embedded default model. Used by both the
base process and clients; imports nothing else of symbiont.
"""
