"""Benchmarks of the dspark_ops kernels: ``python -m bench`` runs them all (see __main__.py)."""
