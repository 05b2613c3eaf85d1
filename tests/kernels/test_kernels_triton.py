"""Every Triton kernel against its torch reference at small, odd shapes (not multiples of the blocks).

Without CUDA the kernels run under TRITON_INTERPRET=1, which tests/conftest.py sets before any test module is
imported (a module that imports transformers decorates triton kernels of torch's own, after which a kernel of ours
decorated under the interpreter calls helpers that were not). With CUDA the same tests run the compiled kernels.
Inputs are fresh random draws; every buffer the kernels allocate starts as NaN (tests/kernels/conftest.py's
`poisoned`), so an unwritten element fails the test.
"""

import pytest
import torch

pytest.importorskip("triton")

from llamaterm.kernels.activation import ACTIVATIONS  # noqa: E402
from llamaterm.kernels.activation import REFERENCES as act_and_mul_refs  # noqa: E402
from llamaterm.kernels.activation_triton import act_and_mul_triton  # noqa: E402
from llamaterm.kernels.attention import paged_attention_ref, write_kv_ref  # noqa: E402
from llamaterm.kernels.attention_triton import AttentionConfig, paged_attention_triton  # noqa: E402
from llamaterm.kernels.linear import linear_ref  # noqa: E402
from llamaterm.kernels.linear_triton import DENSE_M, DENSE_M_KEPT_SMALL, Config, qmatmul_triton  # noqa: E402
from llamaterm.kernels.norm import rms_norm_ref  # noqa: E402
from llamaterm.kernels.norm_triton import rms_norm_triton  # noqa: E402
from llamaterm.kernels.qweight import QuantWeight  # noqa: E402
from llamaterm.kernels.qweight_triton import dequantize_rows_triton, gpu_layout, keep_gpu_layout_only  # noqa: E402
from llamaterm.kernels.rope import rope_ref  # noqa: E402
from llamaterm.kernels.rope_triton import rope_write_kv_triton  # noqa: E402
from tests.support.kernel_cases import (  # noqa: E402
    DEVICE,
    FORMATS,
    SHORT_GROUPS,
    free_outside_window,
    random_mxfp4,
    random_paged_cache,
    random_qweight,
    rel_err,
)

# on the CPU, the Triton interpreter: seconds for some cases, a minute in all
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("poisoned")]

TOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2, torch.float32: 1e-5}


@pytest.mark.parametrize("bits,group,offsets,perm", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_dequantize_rows(bits, group, offsets, perm, dtype):
    w = random_qweight(19, 3 * group, bits, group, offsets, perm)
    ids = torch.tensor([3, 0, 18, 3, 7], device=DEVICE)
    assert rel_err(dequantize_rows_triton(w, ids, dtype), w.rows(ids, dtype)) < TOL[dtype]
    assert rel_err(dequantize_rows_triton(w, None, dtype), w.dequantize(dtype)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_dequantize_rows_mxfp4(dtype):
    """MXFP4 values times power-of-two scales are exact in fp32: the kernel's rows equal the reference's."""
    w = random_mxfp4(19, 96)  # a step and a half
    ids = torch.tensor([3, 0, 18, 3, 7], device=DEVICE)
    assert torch.equal(dequantize_rows_triton(w, ids, dtype), w.rows(ids, dtype))
    assert torch.equal(dequantize_rows_triton(w, None, dtype), w.dequantize(dtype))


@pytest.mark.parametrize("bits,group,offsets,perm", FORMATS)
def test_layout_replaces_packed(bits, group, offsets, perm):
    """A weight kept in its GPU layout alone (as a model on CUDA keeps every quantized weight) frees its packed
    form, still dequantizes to the reference's values (from the layout) and multiplies the same, and says it holds
    the layout's bytes."""
    w = random_qweight(19, 3 * group, bits, group, offsets, perm)
    want, x = w.dequantize(torch.float32), torch.randn(3, 3 * group, device=DEVICE).half()
    before = qmatmul_triton(x, w, CONFIGS[3])
    keep_gpu_layout_only(w)
    assert w.layout_only and w.packed.numel() == 0 and w.scales.numel() == 0
    assert torch.equal(w.dequantize(torch.float32), want)
    assert torch.equal(qmatmul_triton(x, w, CONFIGS[3]), before)
    layout = gpu_layout(w)
    assert w.nbytes() == sum(t.numel() * t.element_size() for t in layout if t is not None)
    with pytest.raises(AssertionError, match="freed"):
        w.take_rows(slice(0, 2))


def test_mxfp4_is_ggufs_mxfp4():
    """GGUF's MXFP4 blocks (an E8M0 exponent byte, then 16 bytes: element j in byte j's low nibble, element j + 16
    in its high nibble) read as QuantWeight codes and bf16 scales: the reference dequantizes them to exactly what
    gguf-py's own MXFP4 dequantizer gives, for every code and exponents 0 (a subnormal scale) to 250; the kernels
    to the same for weights' exponents (the last 12 rows)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    n, k = 24, 128
    exponents = torch.randint(0, 251, (n, k // 32), dtype=torch.uint8)
    exponents[0, :3] = torch.tensor([0, 1, 250], dtype=torch.uint8)
    exponents[12:] = torch.randint(110, 135, (12, k // 32), dtype=torch.uint8)
    qs = torch.randint(0, 256, (n, k // 32, 16), dtype=torch.uint8)
    raw = torch.cat([exponents[..., None], qs], dim=-1)  # [n, blocks, 17]
    want = torch.from_numpy(dequantize(raw.numpy().reshape(n, -1), GGMLQuantizationType.MXFP4).copy())

    codes = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(n, k)  # element j, then element j + 16, of each block
    scales = torch.ldexp(torch.ones(n, k // 32), exponents.int() - 127).to(torch.bfloat16)
    w = QuantWeight.from_values(codes, scales, None, 4, 32, codebook="e2m1")
    assert torch.equal(w.dequantize(), want)
    rows = w.take_rows(slice(12, n)).to(DEVICE)
    assert torch.equal(dequantize_rows_triton(rows, None, torch.float32).cpu(), want[12:])
    x = torch.randn(3, k, device=DEVICE).half()
    assert rel_err(qmatmul_triton(x, rows, CONFIGS[4]), x.float() @ want[12:].T.to(DEVICE)) < TOL[torch.float16]


# Tile configs that exercise a split K with a partial last split, uneven N, full tiles, the 8-token tile and two
# M tiles
CONFIGS = [
    Config(16, 16, 3, 4, 2),
    Config(16, 32, 1, 4, 2),
    Config(64, 16, 2, 4, 1),
    Config(8, 16, 3, 4, 2),
    Config(8, 32, 1, 4, 2),
]


@pytest.mark.parametrize("bits,group,offsets,perm", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "m,config", [(1, CONFIGS[0]), (5, CONFIGS[1]), (70, CONFIGS[2]), (1, CONFIGS[3]), (3, CONFIGS[4])]
)
def test_qmatmul(bits, group, offsets, perm, dtype, m, config):
    k = 3 * group if group < 128 else 2 * group  # 4-bit: 1.5 steps of two groups, or one
    w = random_qweight(40, k, bits, group, offsets, perm, torch.float32 if bits == 8 else torch.float16)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    ref = linear_ref(x.float(), w)
    assert rel_err(qmatmul_triton(x, w, config), ref) < TOL[dtype]
    assert rel_err(qmatmul_triton(x, w, config), ref) < TOL[dtype]  # split counters were reset


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k", [96, 128])  # a step and a half, two steps
@pytest.mark.parametrize("m,config", [(1, CONFIGS[0]), (5, CONFIGS[1]), (70, CONFIGS[2]), (3, CONFIGS[4])])
def test_qmatmul_mxfp4(dtype, k, m, config):
    w = random_mxfp4(40, k)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    ref = linear_ref(x.float(), w)
    assert rel_err(qmatmul_triton(x, w, config), ref) < TOL[dtype]
    assert rel_err(qmatmul_triton(x, w, None, "swiglu_oai"), act_and_mul_refs["swiglu_oai"](ref)) < TOL[dtype]


@pytest.mark.parametrize("bits,group,offsets,perm", FORMATS[:2])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("m,config", [(1, CONFIGS[0]), (5, CONFIGS[1]), (1, CONFIGS[3]), (3, CONFIGS[4]), (300, None)])
def test_qmatmul_gated(bits, group, offsets, perm, activation, m, config):
    """The gate_up projection with its activation in the epilogue: act(gate) * up of the two halves of W's rows
    (20 features: no multiple of the tiles); 300 rows take the dense path, then the activation's own kernel."""
    k = 3 * group if group < 128 else 2 * group
    w = random_qweight(40, k, bits, group, offsets, perm)
    x = torch.randn(m, k, device=DEVICE).half()
    ref = act_and_mul_refs[activation](linear_ref(x.float(), w))
    assert rel_err(qmatmul_triton(x, w, config, activation), ref) < TOL[torch.float16]
    assert rel_err(qmatmul_triton(x, w, config, activation), ref) < TOL[torch.float16]  # split counters were reset


def nan_guarded(t: torch.Tensor) -> torch.Tensor:
    """t's values in a view whose storage continues with NaN: a kernel that reads past the end sees them."""
    buf = torch.full((t.numel() + 256,), float("nan"), dtype=t.dtype, device=t.device)
    buf[: t.numel()] = t.flatten()
    return buf[: t.numel()].view(t.shape)


@pytest.mark.parametrize("bits,offsets", [(4, True), (8, False)])
@pytest.mark.parametrize(
    "m,config",
    [
        (1, Config(8, 64, 2, 4, 3)),
        (1, Config(8, 64, 1, 4, 3)),
        (8, Config(16, 64, 3, 4, 2)),
        (37, Config(64, 128, 2, 8, 3)),
    ],
)
def test_qmatmul_reads_nothing_past_k(bits, offsets, m, config):
    """K = 576 (SmolLM2's hidden size) is no multiple of the steps, as on the GPU for the default model: the
    partial last step must not read scales or offsets past the end."""
    w = random_qweight(70, 576, bits, 32, offsets, False)
    w.scales = nan_guarded(w.scales)
    if offsets:
        w.offsets = nan_guarded(w.offsets)
    x = torch.randn(m, 576, device=DEVICE).half()
    assert rel_err(qmatmul_triton(x, w, config), linear_ref(x.float(), w)) < TOL[torch.float16]


@pytest.mark.parametrize("bits,k,group,offsets,perm", SHORT_GROUPS)
@pytest.mark.parametrize("m,config", [(1, CONFIGS[0]), (5, CONFIGS[1]), (3, CONFIGS[4])])
def test_qmatmul_with_a_short_last_group(bits, k, group, offsets, perm, m, config):
    """The last group shorter than group_size (GPTQModel's 576 in groups of 128): its scales and offsets cover
    only the values K has; nothing past K is read (NaN beyond the scales)."""
    w = random_qweight(40, k, bits, group, offsets, perm)
    w.scales = nan_guarded(w.scales)
    if offsets:
        w.offsets = nan_guarded(w.offsets)
    x = torch.randn(m, k, device=DEVICE).half()
    assert rel_err(qmatmul_triton(x, w, config), linear_ref(x.float(), w)) < TOL[torch.float16]
    ids = torch.tensor([3, 0, 39], device=DEVICE)
    assert rel_err(dequantize_rows_triton(w, ids, torch.float16), w.rows(ids, torch.float16)) < TOL[torch.float16]
    assert rel_err(dequantize_rows_triton(w, None, torch.float32), w.dequantize()) < TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows, keep", [(DENSE_M + 1, False), (DENSE_M_KEPT_SMALL + 1, True)])
def test_qmatmul_dense_path(dtype, rows, keep):
    """Above DENSE_M rows: dequantize, then a dense matmul; with a dense copy kept, a small weight's from
    DENSE_M_KEPT_SMALL rows; also a 3-D input."""
    w = random_qweight(24, 64, 4, 32, True, True)
    if keep:
        w.dense(dtype)
    x = torch.randn(3, rows // 3 + 1, 64, device=DEVICE).to(dtype)
    assert rel_err(qmatmul_triton(x, w), linear_ref(x.float(), w)) < TOL[dtype]


ATTENTION_CASES = [
    # query lengths, context lengths, q heads, kv heads, head dim, page, config (None: the default)
    ([1, 1, 1, 1], [5, 17, 1, 40], 8, 2, 32, 4, None),  # decode, GQA 4
    ([1, 1, 1], [50, 3, 77], 4, 4, 64, 16, AttentionConfig(1, 16, 4, 2, 3)),  # decode split over KV, MHA
    ([1, 0, 1], [70, 3, 2], 6, 2, 24, 4, AttentionConfig(1, 32, 4, 2, 5)),  # idle sequence, head dim 24
    ([9, 1, 13, 3], [9, 20, 40, 7], 8, 2, 32, 4, None),  # chunked prefill: whole prompts, prefix + chunk, decode
    ([40], [75], 4, 1, 16, 16, AttentionConfig(8, 16, 4, 2, 1)),  # long chunk over a prefix, MQA, 3 blocks
    ([5, 1, 6], [5, 30, 6], 8, 2, 32, 4, AttentionConfig(1, 16, 4, 2, 2)),  # prefill in the decode layout, split
]


def random_sinks(with_sinks: bool, n_q: int) -> torch.Tensor | None:
    """gpt-oss's sink logits, one per query head (or None): some below the scores, some above."""
    return 3 * torch.randn(n_q, device=DEVICE) if with_sinks else None


@pytest.mark.parametrize("qlens,ctxs,n_q,n_kv,head_dim,page,config", ATTENTION_CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_paged_attention(qlens, ctxs, n_q, n_kv, head_dim, page, config, dtype, with_sinks):
    k_cache, v_cache, tables = random_paged_cache(ctxs, n_kv, head_dim, page, dtype)
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(ctxs, dtype=torch.int32, device=DEVICE)
    q = torch.randn(int(qsl[-1]), n_q, head_dim, device=DEVICE).to(dtype)
    sinks = random_sinks(with_sinks, n_q)
    out = paged_attention_triton(q, k_cache, v_cache, tables, lens, qsl, head_dim**-0.5, sinks=sinks, config=config)
    ref = paged_attention_ref(q.float(), k_cache, v_cache, tables, lens, qsl, head_dim**-0.5, sinks=sinks)
    assert rel_err(out, ref) < TOL[dtype]


WINDOW_CASES = [
    # query lengths, context lengths, q heads, kv heads, head dim, page, config, sliding window
    ([1, 1, 1, 1], [5, 17, 1, 40], 8, 2, 32, 4, None, 6),  # decode: contexts under and over the window
    ([1, 1, 1], [50, 3, 77], 4, 4, 64, 16, AttentionConfig(1, 16, 4, 2, 3), 21),  # decode split over the window
    ([9, 1, 13, 3], [9, 20, 40, 7], 8, 2, 32, 4, None, 5),  # chunked prefill: chunks longer than the window
    ([40], [75], 4, 1, 16, 16, AttentionConfig(8, 16, 4, 2, 1), 17),  # long chunk, 8 queries a program
    ([5, 1, 6], [5, 30, 6], 8, 2, 32, 4, AttentionConfig(1, 16, 4, 2, 2), 1),  # a window of one: itself
]


@pytest.mark.parametrize("qlens,ctxs,n_q,n_kv,head_dim,page,config,window", WINDOW_CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_paged_attention_sliding_window(qlens, ctxs, n_q, n_kv, head_dim, page, config, window, dtype, with_sinks):
    """With the blocks outside every window freed (NaN, garbage ids in the table), as the engine leaves them."""
    k_cache, v_cache, tables = random_paged_cache(ctxs, n_kv, head_dim, page, dtype)
    free_outside_window(k_cache, v_cache, tables, ctxs, qlens, window)
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(ctxs, dtype=torch.int32, device=DEVICE)
    q = torch.randn(int(qsl[-1]), n_q, head_dim, device=DEVICE).to(dtype)
    sinks = random_sinks(with_sinks, n_q)
    out = paged_attention_triton(q, k_cache, v_cache, tables, lens, qsl, head_dim**-0.5, window, sinks, config)
    ref = paged_attention_ref(q.float(), k_cache, v_cache, tables, lens, qsl, head_dim**-0.5, window, sinks)
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("residual, x_norm", [(False, False), (True, False), (True, True)])
def test_rms_norm(dtype, residual, x_norm):
    x = 3 * torch.randn(5, 100, device=DEVICE).to(dtype)
    res = torch.randn(5, 100, device=DEVICE).to(dtype) if residual else None
    weight, x_weight = ((1 + 0.1 * torch.randn(100, device=DEVICE)).to(dtype) for _ in range(2))
    x_weight = x_weight if x_norm else None
    y, s = rms_norm_triton(x, weight, 1e-5, res, x_weight)
    y_ref, s_ref = rms_norm_ref(x, weight, 1e-5, res, x_weight)
    assert rel_err(y, y_ref) < TOL[dtype] and rel_err(s, s_ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_write_kv(dtype, qk_norm):
    """The rotated q comes back; the rotated k and v land at their slots (slot -1: nowhere), and nothing else in
    the cache is touched (it starts as NaN). With q/k norms, each head is normalized before it is rotated."""
    t, n_q, n_kv, head_dim, page = 6, 9, 3, 48, 4  # groups of 3 query heads, as in SmolLM2
    qkv = torch.randn(t, (n_q + 2 * n_kv) * head_dim, device=DEVICE).to(dtype)  # q, k, v as strided views
    q, k, v = (x.view(t, -1, head_dim) for x in qkv.split([n_q * head_dim, n_kv * head_dim, n_kv * head_dim], -1))
    positions = torch.tensor([0, 1, 7, 300, 8191, 100_000], device=DEVICE)
    inv_freq = 500_000.0 ** -(torch.arange(0, head_dim, 2, device=DEVICE).float() / head_dim)
    inv_freq[head_dim // 4 :] /= 8  # Llama-3-style scaled low frequencies
    slots = torch.tensor([5, -1, 0, 13, 22, 8], device=DEVICE)
    per_token = inv_freq * torch.rand(t, 1, device=DEVICE)  # a row per token, as LongRoPE's long and short factors
    norms = tuple((1 + 0.3 * torch.randn(head_dim, device=DEVICE)).to(dtype) for _ in range(2)) if qk_norm else None
    q_in, k_in = (rms_norm_ref(q, norms[0], 1e-6)[0], rms_norm_ref(k, norms[1], 1e-6)[0]) if qk_norm else (q, k)
    for freq in (inv_freq, per_token):
        caches = [torch.full((6, page, n_kv, head_dim), float("nan"), dtype=dtype, device=DEVICE) for _ in range(4)]
        q_out = rope_write_kv_triton(q, k, v, positions, freq, caches[0], caches[1], slots, norms, 1e-6)
        q_ref, k_ref = rope_ref(q_in, k_in, positions, freq)
        write_kv_ref(k_ref, v, caches[2], caches[3], slots)
        assert rel_err(q_out, q_ref) < TOL[dtype]
        for out, ref in ((caches[0], caches[2]), (caches[1], caches[3])):
            assert torch.equal(out.isnan(), ref.isnan())
        assert rel_err(caches[0].nan_to_num(), caches[2].nan_to_num()) < TOL[dtype]
        assert torch.equal(caches[1].nan_to_num(), caches[3].nan_to_num())  # v is copied as it is


def test_rope_ref_rows_are_per_token():
    """The reference's [T, D/2] form is, for each token, the shared form with that token's row."""
    q, k, positions = torch.randn(4, 3, 16), torch.randn(4, 1, 16), torch.tensor([0, 5, 4096, 9000])
    inv_freq = 10000.0 ** -(torch.arange(8) / 8) * torch.rand(4, 1)
    rows = [rope_ref(q[i : i + 1], k[i : i + 1], positions[i : i + 1], inv_freq[i]) for i in range(4)]
    for got, want in zip(rope_ref(q, k, positions, inv_freq), map(torch.cat, zip(*rows, strict=True)), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_act_and_mul(dtype, activation):
    """Values past swiglu_oai's clamps (+-7) too: a spread of 5."""
    gate_up = (torch.randn(2, 3, 2 * 1100, device=DEVICE) * 5).to(dtype)  # two column blocks per row
    assert rel_err(act_and_mul_triton(gate_up, activation), act_and_mul_refs[activation](gate_up.float())) < TOL[dtype]
