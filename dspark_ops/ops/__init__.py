"""Public wrappers of the custom ops, one module per family, with their fake kernels."""
