"""The forward pass over a paged KV cache, one for every family: what differs between families is data in
ModelConfig (biases, norms, activation, RoPE), read here.

One flat batch of tokens per step: prefill chunks and decode tokens of many sequences side by side,
described by `StepInput` (names as in vLLM: slot mapping, block tables, context lengths). Every op goes through
kernels/, which runs Triton on CUDA and the torch references elsewhere.
"""

from collections.abc import Generator
from dataclasses import dataclass
from typing import TypeVar

import torch

from llamaterm.engine.checkpoints.config import ModelConfig
from llamaterm.kernels.activation import act_and_mul
from llamaterm.kernels.attention import paged_attention
from llamaterm.kernels.dispatch import REFERENCES_ONLY
from llamaterm.kernels.embedding import embedding
from llamaterm.kernels.linear import linear, linear_act
from llamaterm.kernels.moe import Experts, moe, route
from llamaterm.kernels.norm import rms_norm
from llamaterm.kernels.qweight import QuantWeight
from llamaterm.kernels.rope import rope_write_kv

Weight = torch.Tensor | QuantWeight
# Work done a piece at a time: each `next` runs one piece, and the last returns the result. The forward pass comes
# this way too (a piece a half layer), so that CUDA graphs can be recorded between live steps (cuda_graph.py).
Pieces = Generator[None, None, torch.Tensor]
T = TypeVar("T")


def run_through(pieces: Generator[object, None, T]) -> T:
    """All the pieces at once; their result."""
    while True:
        try:
            next(pieces)
        except StopIteration as done:
            return done.value


@dataclass
class StepInput:
    input_ids: torch.Tensor  # [T] tokens of this step, sequence after sequence
    positions: torch.Tensor  # [T] position of each token in its sequence
    slot_mapping: torch.Tensor  # [T] flat KV-cache slot each token's K/V is written to
    block_tables: torch.Tensor  # [B, max_blocks] int32
    context_lens: torch.Tensor  # [B] tokens in cache for each sequence after this step
    query_start_loc: torch.Tensor  # [B + 1] sequence b owns tokens [qsl[b], qsl[b+1])
    logits_indices: torch.Tensor  # [S] rows of the step whose next-token logits are wanted


@dataclass
class StepLists:
    """The same step as host lists, as the model runner builds it from the scheduled chunks (block tables
    unpadded); engine/serving/model_runner.py turns it into a DeviceStep, cuda_graph.py into its fixed buffers."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    block_tables: list[list[int]]
    context_lens: list[int]
    query_start_loc: list[int]
    logits_indices: list[int]
    # per logits row: its sequence's sampler slot (scheduler.py) and the position of the token it samples
    sampler_slots: list[int]
    sample_positions: list[int]
    # input tokens sampled by the step still in flight: step rows pending_rows take that step's sampled tokens
    # pending_from (its rows), on the device (model_runner.py)
    pending_rows: list[int]
    pending_from: list[int]


@dataclass
class DeviceStep:
    """A step on the device: the forward pass's inputs, the sampler's rows (sampler slot -1: a padding row), and
    the indices of the inputs the step in flight fills in."""

    inputs: StepInput
    sampler_slots: torch.Tensor
    sample_positions: torch.Tensor
    pending_rows: torch.Tensor | None  # None: no input waits for the step in flight
    pending_from: torch.Tensor | None


def fuse(parts: list[Weight]) -> list[Weight]:
    """Concatenate same-format weights along the output dim so q/k/v (gate/up) run as one matmul."""
    quantized = [p for p in parts if isinstance(p, QuantWeight)]
    dense = [p for p in parts if isinstance(p, torch.Tensor)]
    if len(quantized) == len(parts):
        try:
            return [QuantWeight.cat(quantized)]
        except ValueError:
            return parts
    if len(dense) == len(parts) and all(p.dtype == dense[0].dtype for p in dense):
        return [torch.cat(dense)]
    return parts


def dense_only(w: Weight) -> torch.Tensor:
    """Norms and biases, which every format stores dense."""
    assert isinstance(w, torch.Tensor), "norms and biases are dense"
    return w


def linear_parts(x: torch.Tensor, parts: list[Weight]) -> torch.Tensor:
    if len(parts) == 1:
        return linear(x, parts[0])
    return torch.cat([linear(x, p) for p in parts], dim=-1)


def gated_parts(x: torch.Tensor, parts: list[Weight], activation: str) -> torch.Tensor:
    """The gated MLP's act(gate) * up, its gate and up projections stacked in `parts`."""
    if len(parts) == 1:
        return linear_act(x, parts[0], activation)
    return act_and_mul(linear_parts(x, parts), activation)


def take_rows(parts: list[Weight], index: torch.Tensor) -> list[Weight]:
    """The rows `index` of the matrix the parts stack into; each part's rows must stay within it."""
    out, start = [], 0
    for w in parts:
        rows = (index[start : start + w.shape[0]] - start).to(
            w.scales.device if isinstance(w, QuantWeight) else w.device
        )
        out.append(w.take_rows(rows) if isinstance(w, QuantWeight) else w[rows])
        start += w.shape[0]
    return out


def rotary_rows(c: ModelConfig) -> torch.Tensor:
    """For partial rotary, the q/k/v rows with each q and k head in ModelConfig.rotary_order."""
    order = c.rotary_order()
    assert order is not None  # called for partial rotary only
    heads = lambda n: (torch.arange(n)[:, None] * c.head_dim + order).flatten()
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    return torch.cat([heads(c.n_heads), q + heads(c.n_kv_heads), torch.arange(q + kv, q + 2 * kv)])


def to_device(w: Weight, device: torch.device, dtype: torch.dtype) -> Weight:
    """Quantized weights keep their format; dense ones (norms, fp16 linears) take the compute dtype."""
    return w.to(device) if isinstance(w, QuantWeight) else w.to(device, dtype)


class GatedMLP:
    """down(act(gate x) * up x): a dense layer's MLP, or a mixture's shared expert."""

    def __init__(self, gate_up: list[Weight], down: Weight, activation: str):
        self.gate_up, self.down, self.activation = gate_up, down, activation

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(gated_parts(x, self.gate_up, self.activation), self.down)

    def matrices(self) -> list[Weight]:
        return [*self.gate_up, self.down]


class MoE:
    """A mixture of experts: the router's top-k experts of each row, summed by its weights (kernels/moe.py), and a
    shared expert every row takes, gated by a sigmoid of its own logit (Qwen2-MoE)."""

    def __init__(self, c: ModelConfig, get, vector, device: torch.device):
        assert c.n_experts is not None and c.n_experts_used is not None
        self.top_k, self.renormalize = c.n_experts_used, c.expert_weights_norm
        self.router = get("ffn_gate_inp")
        self.router_bias = vector("ffn_gate_inp", "bias").float() if c.moe_biases else None
        if gate_up := get("ffn_gate_up_exps", optional=True):  # merged by the file: each expert's gate rows first
            parts = [as_matrix(gate_up)]
        else:
            parts = expert_gate_up(as_matrix(get("ffn_gate_exps")), as_matrix(get("ffn_up_exps")), c.n_experts)
        gate_up_bias = None
        if c.moe_biases:
            gate_up_bias = get("ffn_gate_up_exps", "bias", optional=True)
            if gate_up_bias is None:
                gate_up_bias = torch.cat([vector("ffn_gate_exps", "bias"), vector("ffn_up_exps", "bias")], dim=1)
        self.experts = Experts(
            c.n_experts,
            parts,
            as_matrix(get("ffn_down_exps")),
            c.activation,
            None if gate_up_bias is None else gate_up_bias.float(),
            vector("ffn_down_exps", "bias").float() if c.moe_biases else None,
        )
        self.shared: GatedMLP | None = None
        if c.shared_expert_intermediate_size is not None:
            self.shared = GatedMLP(fuse([get("ffn_gate_shexp"), get("ffn_up_shexp")]), get("ffn_down_shexp"), "silu")
            self.shared_gate = vector("ffn_gate_inp_shexp")  # [1, hidden]: one logit a row

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        logits = linear(x, self.router).float()
        if self.router_bias is not None:
            logits = logits + self.router_bias
        weights, ids = route(logits, self.top_k, self.renormalize)
        y = moe(x, weights, ids, self.experts)
        if self.shared is not None:
            y = y + self.shared(x) * torch.sigmoid(linear(x, self.shared_gate))
        return y

    def matrices(self) -> list[Weight]:
        """The matrices every row multiplies with (the routed experts are not among them)."""
        return [] if self.shared is None else self.shared.matrices()


def as_matrix(w: Weight) -> Weight:
    """A stack of experts [E, N, K] as the matrix [E * N, K] (QuantWeight stacks already are)."""
    return w.reshape(-1, w.shape[-1]) if isinstance(w, torch.Tensor) else w


def expert_gate_up(gate: Weight, up: Weight, n_experts: int) -> list[Weight]:
    """Stacked gate and up [E * I, H] -> one matrix with each expert's gate rows, then its up rows, so one grouped
    matmul with the activation in its epilogue serves both (kernels/moe.py); two parts where their formats
    differ."""
    fused = fuse([gate, up])
    if len(fused) == 2:
        return fused
    i = gate.shape[0] // n_experts
    rows = torch.arange(2 * i * n_experts).view(2, n_experts, i).transpose(0, 1).reshape(-1)  # expert-major
    return take_rows(fused, rows)


class Layer:
    def __init__(self, c: ModelConfig, t: dict[str, Weight], i: int, device, dtype):
        def get(name: str, part: str = "weight", optional: bool = False):
            key = f"blk.{i}.{name}.{part}"
            return None if optional and key not in t else to_device(t[key], device, dtype)

        vector = lambda name, part="weight": dense_only(get(name, part))  # a norm or a bias
        self.window = c.layer_window(i)  # sliding-window attention's keys per query; None: the whole context
        self.sliding_rope = c.rope_theta_sliding is not None and c.is_sliding(i)  # Gemma 3's local RoPE base
        self.attn_norm = vector("attn_norm")
        self.ffn_norm = vector("ffn_norm")
        self.qkv = [get("attn_qkv")] if c.fused_projections else fuse([get("attn_q"), get("attn_k"), get("attn_v")])
        self.qkv_bias = torch.cat([vector(f"attn_{p}", "bias") for p in "qkv"]) if c.qkv_bias else None
        if c.rotary_order() is not None:
            self.qkv = take_rows(self.qkv, rotary_rows(c))
            self.qkv_bias = None if self.qkv_bias is None else self.qkv_bias[rotary_rows(c).to(self.qkv_bias.device)]
        self.qk_norm = (vector("attn_q_norm"), vector("attn_k_norm")) if c.qk_norm else None
        self.o = get("attn_output")
        self.o_bias = vector("attn_output", "bias") if c.o_bias else None
        self.sinks = vector("attn_sinks").float() if c.attention_sinks else None  # gpt-oss's, a logit per head
        self.mlp: GatedMLP | MoE
        if c.is_moe:
            self.mlp = MoE(c, get, vector, device)
        else:
            gate_up = [get("ffn_up")] if c.fused_projections else fuse([get("ffn_gate"), get("ffn_up")])
            self.mlp = GatedMLP(gate_up, get("ffn_down"), c.activation)
        self.post_attn_norm: torch.Tensor | None = vector("post_attention_norm") if c.post_norms else None
        self.post_ffn_norm: torch.Tensor | None = vector("post_ffw_norm") if c.post_norms else None

    def matrices(self) -> list[Weight]:
        """The matrices every row of a step multiplies with (a mixture's routed experts are not among them)."""
        return [*self.qkv, self.o, *self.mlp.matrices()]


class Model:
    def __init__(self, config: ModelConfig, tensors: dict[str, Weight], device: torch.device, dtype: torch.dtype):
        self.config, self.device, self.dtype = config, device, dtype
        self.token_embd = to_device(tensors["token_embd.weight"], device, dtype)
        self.output_norm = dense_only(to_device(tensors["output_norm.weight"], device, dtype))
        self.lm_head = (
            self.token_embd if config.tie_word_embeddings else to_device(tensors["output.weight"], device, dtype)
        )
        self.layers = [Layer(config, tensors, i, device, dtype) for i in range(config.n_layers)]
        self.inv_freq = config.inv_freq().to(device)
        self.long_inv_freq = None if config.rope_long_factors is None else config.inv_freq(long=True).to(device)
        self.sliding_inv_freq = config.inv_freq(sliding=True).to(device)
        self.scale = config.attention_scale or config.head_dim**-0.5
        # LongRoPE's attention factor on the rotated dims of q and k, squared onto q's alone
        self.q_scale: torch.Tensor | None = None
        if config.rope_attention_factor != 1:
            rotated = self.inv_freq.repeat(2) != 0
            self.q_scale = torch.where(rotated, config.rope_attention_factor**2, 1.0).to(dtype)
        if device.type == "cuda" and not REFERENCES_ONLY:  # now, so that the KV cache is sized after them
            from llamaterm.kernels.qweight_triton import keep_gpu_layout_only

            for w in self.quantized_weights():
                keep_gpu_layout_only(w)

    def quantized_weights(self) -> list[QuantWeight]:
        """Every quantized weight, once (a tied lm_head is the embedding)."""
        weights = [self.token_embd, self.lm_head]
        for layer in self.layers:
            weights += layer.matrices()
            if isinstance(layer.mlp, MoE):
                weights += [layer.mlp.router, *layer.mlp.experts.gate_up, layer.mlp.experts.down]
        return list({id(w): w for w in weights if isinstance(w, QuantWeight)}.values())

    def keep_dense_weights(self, budget: int) -> int:
        """Keep dense copies of the blocks' quantized linears when they fit in `budget` bytes, so prefill-sized
        steps run cuBLAS on them instead of dequantizing every weight in every step (kernels/linear_triton.py).
        Returns the bytes kept (0: none, the budget is too small)."""
        weights = [w for layer in self.layers for w in layer.matrices() if isinstance(w, QuantWeight)]
        need = sum(w.shape[0] * w.shape[1] for w in weights) * torch.finfo(self.dtype).bits // 8
        if not weights or need > budget:
            return 0
        for w in weights:
            w.dense(self.dtype)
        return need

    def kv_bytes_per_token(self) -> int:
        c = self.config
        return 2 * c.n_layers * c.n_kv_heads * c.head_dim * torch.finfo(self.dtype).bits // 8

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> torch.Tensor:
        """[n_layers, 2 (k, v), num_blocks, block_size, n_kv_heads, head_dim], allocated once.

        Left unset: no kernel reads a slot before it is written, so on the CPU a block's pages become resident only
        when it is first used, and a one-shot command holds the memory its tokens need, not the whole pool's."""
        c = self.config
        shape = (c.n_layers, 2, num_blocks, block_size, c.n_kv_heads, c.head_dim)
        return torch.empty(shape, dtype=self.dtype, device=self.device)

    def forward(self, step: StepInput, kv_cache: torch.Tensor) -> torch.Tensor:
        """Runs one step; returns fp32 logits [S, vocab] for step.logits_indices."""
        return run_through(self.forward_pieces(step, kv_cache))

    @torch.inference_mode()
    def forward_pieces(self, step: StepInput, kv_cache: torch.Tensor) -> Pieces:
        """The forward pass, a piece a half layer (the output's norm and the logits in the last)."""
        c = self.config
        n_tokens = step.input_ids.shape[0]
        q_size, kv_size = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        h = embedding(step.input_ids, self.token_embd, self.dtype)
        if c.embedding_scale != 1:
            h = h * c.embedding_scale
        inv_freq = self.inv_freq
        if self.long_inv_freq is not None:  # LongRoPE: from the original context on, the long factors
            assert c.rope_long_from is not None
            inv_freq = torch.where((step.positions >= c.rope_long_from)[:, None], self.long_inv_freq, inv_freq)
        residual: torch.Tensor | None = None
        post_norm: torch.Tensor | None = None  # Gemma's norm of the last sublayer's output, fused into the next
        for layer, (k_cache, v_cache) in zip(self.layers, kv_cache, strict=True):
            x, residual = rms_norm(h, layer.attn_norm, c.rms_norm_eps, residual, post_norm)
            qkv = linear_parts(x, layer.qkv)
            if layer.qkv_bias is not None:
                qkv = qkv + layer.qkv_bias
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q = q.view(n_tokens, c.n_heads, c.head_dim)
            k = k.view(n_tokens, c.n_kv_heads, c.head_dim)
            v = v.reshape(n_tokens, c.n_kv_heads, c.head_dim)
            freq = self.sliding_inv_freq if layer.sliding_rope else inv_freq
            q = rope_write_kv(
                q, k, v, step.positions, freq, k_cache, v_cache, step.slot_mapping, layer.qk_norm, c.rms_norm_eps
            )
            if self.q_scale is not None:
                q = q * self.q_scale
            o = paged_attention(
                q,
                k_cache,
                v_cache,
                step.block_tables,
                step.context_lens,
                step.query_start_loc,
                self.scale,
                layer.window,
                layer.sinks,
            )
            h = linear(o.view(n_tokens, q_size), layer.o)
            if layer.o_bias is not None:
                h = h + layer.o_bias
            yield  # half a layer a piece: a capture's pieces then sit within half a small model's step
            x, residual = rms_norm(h, layer.ffn_norm, c.rms_norm_eps, residual, layer.post_attn_norm)
            h = layer.mlp(x)
            post_norm = layer.post_ffn_norm
            yield
        last = step.logits_indices
        assert residual is not None  # a model has layers
        x, _ = rms_norm(h[last], self.output_norm, c.rms_norm_eps, residual[last], post_norm)
        logits = linear(x, self.lm_head).float()
        if c.final_logit_softcap is not None:
            logits = c.final_logit_softcap * torch.tanh(logits / c.final_logit_softcap)
        return logits
