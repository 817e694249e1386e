"""What the torch and JAX backends share below Python: the C++ row-kernel headers
(``row_kernels.h``), the drivers both bind (``drivers.h``: the dense optimizer's chunked update,
the all-finite check, the row gather, the huge-page hint; torch through ctypes on OpenMP threads,
JAX through XLA's FFI on its thread pool), the build driver that compiles a backend's ``.cc`` on first use
(:mod:`meshembed_native.build`) and the huge-page hint for large CPU tables
(:mod:`meshembed_native.pages`). Backend-side, so the core (``meshembed``) stays free of
C++ and of any framework; imports nothing but the standard library.
"""
