"""Token embedding lookup; quantized tables dequantize only the rows looked up."""

import torch

from kernels.dispatch import use_triton
from kernels.qweight import QuantWeight


def embedding(ids: torch.Tensor, table: torch.Tensor | QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(table, torch.Tensor):
        return table[ids].to(dtype)
    if use_triton(ids):
        from kernels.embedding_triton import embedding_triton

        return embedding_triton(ids, table, dtype)
    return table.rows(ids, dtype)
