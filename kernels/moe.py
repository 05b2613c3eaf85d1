"""Mixture-of-experts MLPs: routing a step's rows to their top-k experts, and the experts' gated MLPs summed by the
routing weights.

A layer's experts are stacked along the output dimension (`Experts`): expert e's gate rows, then its up rows, are
rows [2Ie, 2I(e + 1)) of one gate_up matrix [E * 2I, H] (or gate and up apart, [E * I, H] each, where a file stores
them in different formats), and its down rows are rows [He, H(e + 1)) of one down matrix [E * H, I]. So an expert
is a slice of rows of one weight, quantized (QuantWeight, any format, MXFP4 too) or dense, and one grouped kernel
reads any expert's rows from the same tensors.

The torch reference loops over the experts the step's rows chose (the CPU path and the test oracle); on CUDA
kernels/moe_triton.py sorts the (row, expert) pairs by expert on the device and runs grouped matmuls, with no host
sync, so the step stays inside its CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llamaterm.kernels.activation import act_and_mul
from llamaterm.kernels.dispatch import use_triton
from llamaterm.kernels.linear import linear
from llamaterm.kernels.qweight import QuantWeight

Weight = torch.Tensor | QuantWeight


@dataclass
class Experts:
    """One layer's routed experts (see the module docstring for the stacking)."""

    n_experts: int
    gate_up: list[Weight]  # one part [E * 2I, H], or gate and up parts [E * I, H] each
    down: Weight  # [E * H, I]
    activation: str  # kernels/activation.py's ACTIVATIONS
    gate_up_bias: torch.Tensor | None = None  # [E, 2I]: each expert's gate bias, then its up bias (gpt-oss)
    down_bias: torch.Tensor | None = None  # [E, H] (gpt-oss)
    # each expert's slices, made once: a slice keeps what a kernel prepares of it (the CPU's scale layout)
    _slices: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def intermediate_size(self) -> int:
        return sum(w.shape[0] for w in self.gate_up) // (2 * self.n_experts)

    def expert_gate_up(self, e: int) -> list[Weight]:
        """Expert e's gate_up parts: slices of the stacked weights (views, no copy)."""
        return self._expert(e)[0]

    def expert_down(self, e: int) -> Weight:
        return self._expert(e)[1]

    def _expert(self, e: int) -> tuple[list[Weight], Weight]:
        if e not in self._slices:
            gate_up = [rows(w, e, w.shape[0] // self.n_experts) for w in self.gate_up]
            self._slices[e] = gate_up, rows(self.down, e, self.down.shape[0] // self.n_experts)
        return self._slices[e]


def rows(w: Weight, e: int, n: int) -> Weight:
    """Rows [n e, n (e + 1)) of w."""
    return w.take_rows(slice(n * e, n * (e + 1))) if isinstance(w, QuantWeight) else w[n * e : n * (e + 1)]


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [M, E] -> (weights fp32 [M, k], expert ids int32 [M, k]), the experts by falling weight.
    renormalize: the weights are the softmax over the k chosen logits (Mixtral, Qwen3-MoE's norm_topk_prob, gpt-oss:
    the same as a softmax over all E renormalized over the k); otherwise the softmax over all E, unnormalized over
    the k (Qwen2-MoE)."""
    if use_triton(logits):
        from llamaterm.kernels.moe_triton import route_triton

        return route_triton(logits, top_k, renormalize)
    return route_ref(logits, top_k, renormalize)


def route_ref(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits.float()
    if renormalize:
        top, ids = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids.to(torch.int32)
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    return weights, ids.to(torch.int32)


def moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: Experts) -> torch.Tensor:
    """sum_j weights[:, j] * expert_{ids[:, j]}(x) for x [M, H] -> [M, H] in x's dtype, where expert_e(x) =
    down_e(act(gate_e x + bg_e) * (up_e x + bu_e)) + bd_e."""
    if use_triton(x):
        from llamaterm.kernels.moe_triton import moe_triton

        return moe_triton(x, weights, ids, experts)
    return moe_ref(x, weights, ids, experts)


def moe_ref(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: Experts) -> torch.Tensor:
    """A loop over the experts chosen in this step (host syncs: the CPU path and the oracle)."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        row, slot = torch.nonzero(ids == e, as_tuple=True)
        h = x[row]
        parts = [linear(h, w) for w in experts.expert_gate_up(e)]
        gate_up = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        if experts.gate_up_bias is not None:
            gate_up = gate_up + experts.gate_up_bias[e].to(gate_up.dtype)
        y = linear(act_and_mul(gate_up, experts.activation), experts.expert_down(e))
        if experts.down_bias is not None:
            y = y + experts.down_bias[e].to(y.dtype)
        out.index_add_(0, row, y.float() * weights[row, slot, None])
    return out.to(x.dtype)
