"""Kernel tests run the Triton kernels in the Triton interpreter on CPU."""

import os

# NOTE: must precede the first import of a kernel module: @triton.jit picks the
# interpreter at decoration time. setdefault lets a GPU run override it (=0).
os.environ.setdefault("TRITON_INTERPRET", "1")
