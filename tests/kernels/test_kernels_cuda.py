"""The Triton path at real Llama-3-8B shapes, through the public dispatch functions, against the torch references
(computed in fp32 on the GPU). Skipped without CUDA; the small odd-shape tests are in test_kernels_triton.py."""

import pytest
import torch

from llamaterm.kernels.activation import ACTIVATIONS, REFERENCES, act_and_mul
from llamaterm.kernels.attention import paged_attention, paged_attention_ref, write_kv_ref
from llamaterm.kernels.embedding import embedding
from llamaterm.kernels.linear import linear, linear_ref
from llamaterm.kernels.moe import Experts, moe, moe_ref, route, route_ref
from llamaterm.kernels.norm import rms_norm, rms_norm_ref
from llamaterm.kernels.qweight import QuantWeight
from llamaterm.kernels.rope import rope_ref, rope_write_kv
from tests.support.kernel_cases import moe_layer

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
TOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2}


def rel_err(out, ref) -> float:
    assert out.shape == ref.shape and not out.isnan().any()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def random_qweight(n, k, bits, group, offsets=False, perm=False) -> QuantWeight:
    q = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, device="cuda")
    scales = (torch.rand(n, k // group, device="cuda") * 0.01 + 0.001).half()
    offs = (torch.randn(n, k // group, device="cuda") * 0.01).half() if offsets else None
    p = torch.randperm(k, device="cuda") if perm else None
    return QuantWeight.from_values(q, scales, offs, bits, group, p)


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
@pytest.mark.parametrize("group", [128, 32])
@pytest.mark.parametrize("m", [1, 3, 16, 64, 128, 300])
def test_linear_llama_shapes(n, k, group, m):
    w = random_qweight(n, k, 4, group)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    assert rel_err(linear(x, w), linear_ref(x.float(), w)) < TOL[torch.bfloat16]


@pytest.mark.parametrize("bits,group,offsets,perm", [(4, 64, True, True), (8, 32, True, False), (8, 16, False, True)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 24, 64])
def test_linear_formats(bits, group, offsets, perm, dtype, m):
    w = random_qweight(4096, 4096, bits, group, offsets, perm)
    x = torch.randn(m, 4096, device="cuda", dtype=dtype)
    assert rel_err(linear(x, w), linear_ref(x.float(), w)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 8, 16, 64, 300])
def test_linear_mxfp4(dtype, m):
    """gpt-oss-20b's expert gate_up shape in MXFP4 (the PTX unpack of E2M1 codes; 300 rows: dequantize + cuBLAS)."""
    q = torch.randint(0, 16, (5760, 2880), dtype=torch.uint8, device="cuda")
    scales = torch.exp2(torch.randint(-12, -4, (5760, 90), device="cuda").float()).to(torch.bfloat16)
    w = QuantWeight.from_values(q, scales, None, 4, 32, codebook="e2m1")
    x = torch.randn(m, 2880, device="cuda", dtype=dtype)
    assert rel_err(linear(x, w), linear_ref(x.float(), w)) < TOL[dtype]
    ids = torch.randint(0, 5760, (5, 7), device="cuda")
    assert torch.equal(embedding(ids, w, dtype), w.rows(ids.flatten(), dtype).view(5, 7, -1))


def test_embedding_rows():
    table = random_qweight(128256, 4096, 4, 32, offsets=True)
    ids = torch.randint(0, 128256, (5, 7), device="cuda")
    ref = table.rows(ids.flatten(), torch.float32).view(5, 7, -1)
    assert rel_err(embedding(ids, table, torch.bfloat16), ref) < TOL[torch.bfloat16]


def paged(ctxs, page=16, n_kv=8, head_dim=128, dtype=torch.float16):
    blocks = [-(-c // page) for c in ctxs]
    k_cache = torch.randn(sum(blocks) + 4, page, n_kv, head_dim, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    ids = torch.randperm(k_cache.shape[0], device="cuda", dtype=torch.int32)
    tables = torch.zeros(len(ctxs), max(blocks), dtype=torch.int32, device="cuda")
    start = 0
    for b, nb in enumerate(blocks):
        tables[b, :nb] = ids[start : start + nb]
        start += nb
    return k_cache, v_cache, tables


@pytest.mark.parametrize(
    "qlens,ctxs",
    [
        ([1] * 8, [4096, 1, 17, 700, 8000, 129, 2048, 4095]),  # decode batch: KV split, 128-key steps
        ([1] * 20, [1000 + 97 * i for i in range(20)]),  # 160 programs: no split, 128-key steps (H200)
        ([1], [32768]),  # one long decode: flash-decoding splits
        ([2048], [2048]),  # a whole 2k prompt
        ([512, 1, 300, 1], [2048, 900, 300, 5000]),  # chunked prefill beside decodes
    ],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_attention_llama(qlens, ctxs, dtype):
    k_cache, v_cache, tables = paged(ctxs, dtype=dtype)
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    lens = torch.tensor(ctxs, dtype=torch.int32, device="cuda")
    q = torch.randn(int(qsl[-1]), 32, 128, device="cuda", dtype=dtype)
    out = paged_attention(q, k_cache, v_cache, tables, lens, qsl, 128**-0.5)
    ref = paged_attention_ref(q.float(), k_cache, v_cache, tables, lens, qsl, 128**-0.5)
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize(
    "qlens,ctxs",
    [([1] * 8, [4096, 1, 17, 700, 8000, 129, 2048, 4095]), ([1], [32768]), ([512, 1, 300, 1], [2048, 900, 300, 5000])],
)
@pytest.mark.parametrize("window", [None, 128])
def test_paged_attention_gpt_oss(qlens, ctxs, window):
    """gpt-oss-20b's attention: 64 query heads over 8 KV heads of 64, a sink logit per head, full or banded
    (a 128-token window) layers."""
    k_cache, v_cache, tables = paged(ctxs, n_kv=8, head_dim=64, dtype=torch.bfloat16)
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    lens = torch.tensor(ctxs, dtype=torch.int32, device="cuda")
    q = torch.randn(int(qsl[-1]), 64, 64, device="cuda", dtype=torch.bfloat16)
    sinks = 3 * torch.randn(64, device="cuda")
    out = paged_attention(q, k_cache, v_cache, tables, lens, qsl, 64**-0.5, window, sinks)
    ref = paged_attention_ref(q.float(), k_cache, v_cache, tables, lens, qsl, 64**-0.5, window, sinks)
    assert rel_err(out, ref) < TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_small_ops_llama(dtype):
    t = 77
    x, res = (torch.randn(t, 4096, device="cuda", dtype=dtype) for _ in range(2))
    weight = torch.rand(4096, device="cuda", dtype=dtype) + 0.5
    for out, ref in zip(rms_norm(x, weight, 1e-5, res), rms_norm_ref(x, weight, 1e-5, res), strict=True):
        assert rel_err(out, ref) < TOL[dtype]
    for out, ref in zip(
        rms_norm(x, weight, 1e-5, res, weight.flip(0)), rms_norm_ref(x, weight, 1e-5, res, weight.flip(0)), strict=True
    ):  # Gemma's post-norm before the add
        assert rel_err(out, ref) < TOL[dtype]

    gate_up = torch.randn(t, 28672, device="cuda", dtype=dtype)
    for activation in ACTIVATIONS:
        assert rel_err(act_and_mul(gate_up, activation), REFERENCES[activation](gate_up.float())) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n_q, n_kv, head_dim, qk_norm", [(32, 8, 128, False), (8, 4, 256, True)])  # Llama 3, Gemma 3
def test_rope_write_kv_real_shapes(dtype, n_q, n_kv, head_dim, qk_norm):
    t = 77
    qkv = torch.randn(t, (n_q + 2 * n_kv) * head_dim, device="cuda", dtype=dtype)
    q, k, v = qkv.split([n_q * head_dim, n_kv * head_dim, n_kv * head_dim], dim=-1)
    q, k, v = q.view(t, n_q, head_dim), k.view(t, n_kv, head_dim), v.reshape(t, n_kv, head_dim)
    positions = torch.randint(0, 131072, (t,), device="cuda")
    inv_freq = 500_000.0 ** -(torch.arange(0, head_dim, 2, device="cuda").float() / head_dim)
    norms = tuple(torch.rand(head_dim, device="cuda", dtype=dtype) + 0.5 for _ in range(2)) if qk_norm else None
    k_cache, v_cache, _ = paged([200], n_kv=n_kv, head_dim=head_dim, dtype=dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(k_cache.shape[0] * 16, device="cuda")[:t]
    slots[3] = -1
    q_out = rope_write_kv(q, k, v, positions, inv_freq, k_cache, v_cache, slots, norms, 1e-6)
    if qk_norm:
        q, k = rms_norm_ref(q, norms[0], 1e-6)[0], rms_norm_ref(k, norms[1], 1e-6)[0]
    q_rot, k_rot = rope_ref(q, k, positions, inv_freq)
    write_kv_ref(k_rot, v, k_ref, v_ref, slots)
    assert rel_err(q_out, q_rot) < TOL[dtype] and rel_err(k_cache, k_ref) < TOL[dtype]
    assert torch.equal(v_cache, v_ref)


def dense_fp32(experts: Experts) -> Experts:
    """The same experts dequantized to fp32 (the oracle multiplies them with F.linear)."""
    return Experts(
        experts.n_experts,
        [w.dequantize() for w in experts.gate_up],
        experts.down.dequantize(),
        experts.activation,
        experts.gate_up_bias,
        experts.down_bias,
    )


@pytest.mark.parametrize("model", ["qwen3", "gpt-oss"])
def test_moe_real_shapes(model):
    experts, top_k = moe_layer(model)
    oracle = dense_fp32(experts)
    for m in (1, 4, 8, 64, 300):
        logits = torch.randn(m, experts.n_experts, device="cuda")
        weights, ids = route(logits, top_k, True)
        want_weights, want_ids = route_ref(logits, top_k, True)
        assert torch.equal(ids, want_ids) and rel_err(weights, want_weights) < 1e-6
        for dtype in (torch.float16, torch.bfloat16):
            x = torch.randn(m, experts.down.shape[0] // experts.n_experts, device="cuda", dtype=dtype)
            assert rel_err(moe(x, weights, ids, experts), moe_ref(x.float(), weights, ids, oracle)) < TOL[dtype]


def test_moe_in_a_cuda_graph():
    """Routing and experts captured once (no host sync: the capture would fail on one) replay on new inputs as they
    run eagerly."""
    experts, top_k = moe_layer("qwen3")
    x = torch.randn(4, 2048, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(4, experts.n_experts, device="cuda")
    layer = lambda: moe(x, *route(logits, top_k, True), experts)  # noqa: E731
    layer()  # compile, and the layouts and counters exist before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer()
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        logits.copy_(torch.randn_like(logits))
        graph.replay()
        assert torch.equal(out, layer())
