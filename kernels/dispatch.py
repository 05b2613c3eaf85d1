"""The one switch between Triton kernels and torch references.

Triton runs only on CUDA tensors, unless LLAMATERM_KERNELS=torch forces the references everywhere (for
comparisons). Tests of the Triton code on the CPU call the `*_triton` functions directly under TRITON_INTERPRET=1.
"""

import os

import torch

_force_reference = os.environ.get("LLAMATERM_KERNELS", "").lower() == "torch"


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and not _force_reference
