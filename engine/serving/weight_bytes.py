"""The bytes of weights a decode step reads, which bound its speed on a device's memory bandwidth (`llamaterm bench`
shows tokens/s beside that bound)."""

from llamaterm.engine.serving.model import Model, MoE, Weight
from llamaterm.kernels.qweight import QuantWeight


def weight_bytes(model: Model) -> int:
    """Bytes of weights one decode step reads: the quantized weights' layout on the GPU (dense copies kept for
    prefill are not read by decode steps); the dense copies the CPU reference path multiplies with."""
    parts = [model.lm_head, model.output_norm]
    for layer in model.layers:
        parts += [*layer.matrices(), layer.attn_norm, layer.ffn_norm]
    experts = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE)]
    return sum(read_bytes(w) for w in parts) + sum(expert_read_bytes(moe) for moe in experts)


def expert_read_bytes(moe: MoE) -> int:
    """A mixture's layer at one session reads its router and the top-k experts of the one row."""
    e = moe.experts
    routed = sum(read_bytes(w) for w in (*e.gate_up, e.down)) * moe.top_k // e.n_experts
    return read_bytes(moe.router) + routed


def read_bytes(w: Weight) -> int:
    """The bytes of w a decode step reads (see weight_bytes)."""
    size = lambda t: 0 if t is None else t.numel() * t.element_size()
    if not isinstance(w, QuantWeight):
        return size(w)
    if w.packed.device.type == "cpu" and w._dense:
        return sum(map(size, w._dense.values()))
    return w.nbytes()
