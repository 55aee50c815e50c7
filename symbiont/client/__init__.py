"""The client side: an ordinary HF model whose frozen linear layers run on an executor."""

from symbiont.client.loader import load_client
from symbiont.client.virt import VirtConv1D, VirtLayer, VirtLinear

__all__ = ["load_client", "VirtLayer", "VirtLinear", "VirtConv1D"]
