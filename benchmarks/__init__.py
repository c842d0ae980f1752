"""Side-by-side benchmarks of scaler-core against the usual ways to unscale gradients.

Run from the repository root, with scaler-core installed (``pip install -e ".[fast]"``)::

    python -m benchmarks            # the full sets (about 1.5 GB of RAM, a few minutes)
    python -m benchmarks --small    # a seconds-long smoke run (CI)

Contenders and gradient sets are plain functions registered in
:mod:`benchmarks._sets` and :mod:`benchmarks._contenders`; adding one (JAX,
CuPy on a GPU) is adding a function there.
"""
