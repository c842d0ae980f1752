"""Backends of scaler-core, one private module per array library (NumPy, CuPy, JAX,
PyTorch, MLX), and one for any library implementing the Array API standard.

Installed as ``scaler_core.backends``. Import nothing here: each backend loads
lazily through :func:`scaler_core.get_backend` so that using NumPy never
imports JAX, CuPy or PyTorch (``torch``).
"""
