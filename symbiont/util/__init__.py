"""Small helpers every package may use (imports nothing else of symbiont): lazy package
namespaces, the one sliding-window rate meter behind every tokens/s figure, and device
names checked before anything is loaded onto them."""
