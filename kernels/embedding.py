"""Token embedding lookup; quantized tables dequantize only the rows looked up."""

import torch

from llamaterm.kernels.dispatch import use_triton
from llamaterm.kernels.qweight import QuantWeight


def embedding(ids: torch.Tensor, table: torch.Tensor | QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(table, torch.Tensor):
        return table[ids].to(dtype)
    if use_triton(ids):
        from llamaterm.kernels.qweight_triton import dequantize_rows_triton

        return dequantize_rows_triton(table, ids.reshape(-1), dtype).view(*ids.shape, table.shape[1])
    return table.rows(ids, dtype)
