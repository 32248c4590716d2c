"""Imported by pytest before any test module: optimized_stack pins MKL's code branch at import
(optimized_stack/numerics.py), which only works before the first MKL call of the process."""
import optimized_stack  # noqa: F401
