"""The one switch between Triton kernels and torch references.

Triton runs only on CUDA tensors, unless LLAMATERM_KERNELS=torch forces the references everywhere (for
comparisons). Tests of the Triton code on the CPU call the `*_triton` functions directly under TRITON_INTERPRET=1.
"""

import os

import torch

# LLAMATERM_KERNELS=torch: the torch references everywhere, neither Triton nor the CPU's native kernels
# (kernels/cpu_native.py asks here too). Read once: use_triton runs at every kernel call.
REFERENCES_ONLY = os.environ.get("LLAMATERM_KERNELS", "").lower() == "torch"


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and not REFERENCES_ONLY
