"""symbiont's CPU kernels: C++ built once on the machine (library.py), and the base
products of a few rows (few_rows.py). Imports torch only: the serving engine, the executors
and `serve-base` all use it."""
