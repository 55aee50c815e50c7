"""Small helpers every package may use (imports nothing else of symbiont): lazy package
namespaces, and the one sliding-window rate meter behind every tokens/s figure."""
