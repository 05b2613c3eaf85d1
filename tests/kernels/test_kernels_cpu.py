"""The CPU's native kernels (kernels/cpu_native.c) against the torch references, at odd shapes, in every weight
format; and the fallback to the references where the kernels cannot be built."""

import os
import subprocess
import sys

import pytest
import torch

from llamaterm.kernels import ops_cpu
from llamaterm.kernels.activation import ACTIVATIONS, REFERENCES
from llamaterm.kernels.attention import paged_attention_ref, write_kv_ref
from llamaterm.kernels.cpu_native import library
from llamaterm.kernels.linear import linear_ref
from llamaterm.kernels.norm import rms_norm_ref
from llamaterm.kernels.rope import rope_ref
from tests.support import ROOT
from tests.support.kernel_cases import (
    FORMATS,
    SHORT_GROUPS,
    free_outside_window,
    random_mxfp4,
    random_paged_cache,
    random_qweight,
    rel_err,
)

FP32_TOL = 1e-6  # fp32 sums in another order


@pytest.fixture(scope="module")
def lib():
    lib = library()
    assert lib is not None, "the native CPU kernels did not build on this machine"
    return lib


def native_dequantize(w, lib) -> torch.Tensor:
    scales, offsets = ops_cpu.cpu_params(w)
    out = torch.full(w.shape, float("nan"))
    f16, e2m1 = int(scales.dtype == torch.float16), int(w.codebook == "e2m1")
    args = (ops_cpu.ptr(offsets), f16, w.bits, e2m1, w.group_size, w.shape[1], w.shape[0], out.data_ptr(), 2)
    lib.dequantize(w.packed.data_ptr(), scales.data_ptr(), *args)
    return out


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("bits,group,offsets,perm", FORMATS)
def test_dequantize_is_exact(lib, bits, group, offsets, perm, scale_dtype):
    """The expansion of the packed values is bit for bit the reference's fp32 dequantization."""
    w = random_qweight(37, 3 * group, bits, group, offsets, perm, scale_dtype, device="cpu")
    assert torch.equal(native_dequantize(w, lib), w.dequantize())


def test_mxfp4_dequantize_is_exact(lib):
    """MXFP4: bf16 power-of-two scales times E2M1 values, every code, bit for bit the reference's."""
    w = random_mxfp4(37, 96, device="cpu")
    assert torch.equal(native_dequantize(w, lib), w.dequantize())


@pytest.mark.parametrize("rows", [1, 3, ops_cpu.DENSE_FROM_ROWS + 1])
def test_mxfp4_qmatmul(lib, rows):
    w = random_mxfp4(45, 160, exponents=(-8, -3), device="cpu")
    x = torch.randn(rows, w.shape[1])
    assert rel_err(ops_cpu.qmatmul_cpu(x, w, lib), linear_ref(x, w)) < FP32_TOL


@pytest.mark.parametrize("rows", [1, 3, ops_cpu.DENSE_FROM_ROWS + 1])
@pytest.mark.parametrize("bits,group,offsets,perm", FORMATS)
def test_qmatmul(lib, bits, group, offsets, perm, rows):
    w = random_qweight(45, 5 * group, bits, group, offsets, perm, device="cpu")
    x = torch.randn(rows, w.shape[1])
    assert rel_err(ops_cpu.qmatmul_cpu(x, w, lib), linear_ref(x, w)) < FP32_TOL


@pytest.mark.parametrize("bits,k,group,offsets,perm", SHORT_GROUPS)
def test_reference_dequantize_with_a_short_last_group(bits, k, group, offsets, perm):
    """QuantWeight's w = scale * q + offset (or scale * (q - 2**(bits-1))) in fp32, element by element: column c
    is in group c // group, the last group holding what is left of K."""
    w = random_qweight(7, k, bits, group, offsets, perm, device="cpu")
    q, s = w.values().float(), w.scales.float()
    want = torch.empty(7, k)
    for c in range(k):
        g = c // group
        want[:, c] = s[:, g] * q[:, c] + w.offsets[:, g].float() if offsets else s[:, g] * (q[:, c] - 2 ** (bits - 1))
    assert w.scales.shape == (7, -(-k // group)) and torch.equal(w.dequantize(), want)


@pytest.mark.parametrize("rows", [1, 3, ops_cpu.DENSE_FROM_ROWS + 1])
@pytest.mark.parametrize("bits,k,group,offsets,perm", SHORT_GROUPS)
def test_qmatmul_with_a_short_last_group(lib, bits, k, group, offsets, perm, rows):
    w = random_qweight(45, k, bits, group, offsets, perm, device="cpu")
    x = torch.randn(rows, k)
    assert rel_err(ops_cpu.qmatmul_cpu(x, w, lib), linear_ref(x, w)) < FP32_TOL


@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm(lib, residual):
    x, w = torch.randn(5, 72), torch.randn(72)
    r = torch.randn(5, 72) if residual else None
    out, total = ops_cpu.rms_norm_cpu(x, w, 1e-6, r, lib)
    ref, ref_total = rms_norm_ref(x, w, 1e-6, r)
    assert rel_err(out, ref) < FP32_TOL and torch.equal(total, ref_total)


def test_rope(lib):
    q, k = torch.randn(7, 6, 24), torch.randn(7, 2, 24)
    positions, inv_freq = torch.tensor([0, 1, 2, 30, 31, 500, 4095]), 10000.0 ** -(torch.arange(12) / 12)
    for out, ref in zip(
        ops_cpu.rope_cpu(q, k, positions, inv_freq, lib), rope_ref(q, k, positions, inv_freq), strict=True
    ):
        assert rel_err(out, ref) < FP32_TOL
    per_token = inv_freq * torch.rand(7, 1)  # a row per token (LongRoPE)
    for out, ref in zip(
        ops_cpu.rope_cpu(q, k, positions, per_token, lib), rope_ref(q, k, positions, per_token), strict=True
    ):
        assert rel_err(out, ref) < FP32_TOL


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_act_and_mul(lib, activation):
    gate_up = torch.randn(3, 2 * 50) * 5  # past swiglu_oai's clamps (+-7) too
    assert rel_err(ops_cpu.act_and_mul_cpu(gate_up, activation, lib), REFERENCES[activation](gate_up)) < FP32_TOL


@pytest.mark.parametrize(
    "qlens,ctxs,n_q,n_kv,head_dim,page",
    [
        ([1, 1, 1, 1], [5, 17, 1, 40], 8, 2, 32, 4),  # decode, GQA 4
        ([1, 0, 1], [70, 3, 2], 6, 2, 24, 4),  # an idle sequence, head dim 24
        ([9, 1, 13, 3], [9, 20, 40, 7], 8, 2, 32, 4),  # chunked prefill: whole prompts, prefix + chunk, decode
        ([40], [75], 3, 1, 16, 16),  # a long chunk over a prefix, MQA
    ],
)
@pytest.mark.parametrize("window", [None, 1, 6, 21])  # sliding windows: itself only, under a page, across pages
@pytest.mark.parametrize("with_sinks", [False, True])  # gpt-oss's sink logits, some below the scores, some above
def test_paged_attention(lib, qlens, ctxs, n_q, n_kv, head_dim, page, window, with_sinks):
    k_cache, v_cache, tables = random_paged_cache(ctxs, n_kv, head_dim, page, torch.float32, device="cpu")
    if window is not None:
        free_outside_window(k_cache, v_cache, tables, ctxs, qlens, window)
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()])
    lens = torch.tensor(ctxs)
    q = torch.randn(int(qsl[-1]), n_q, head_dim)
    sinks = 3 * torch.randn(n_q) if with_sinks else None
    out = ops_cpu.paged_attention_cpu(q, k_cache, v_cache, tables, lens, qsl, head_dim**-0.5, window, sinks, lib)
    ref = paged_attention_ref(q, k_cache, v_cache, tables, lens, qsl, head_dim**-0.5, window, sinks)
    assert rel_err(out, ref) < FP32_TOL


@pytest.mark.parametrize("n,ctx,window", [(1, 30, 7), (30, 30, 7), (12, 30, 4), (9, 30, 100), (5, 9, 1)])
def test_reference_window_is_transformers_sliding_window_mask(n, ctx, window):
    """The reference's sliding window against transformers' own mask definition (what MistralForCausalLM applies),
    in a dense softmax over an unpaged context: query i at position ctx - n + i, GQA 2."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    n_q, n_kv, head_dim, page = 4, 2, 16, 4
    k_cache, v_cache, tables = random_paged_cache([ctx], n_kv, head_dim, page, torch.float32, device="cpu")
    q = torch.randn(n, n_q, head_dim)
    ref = paged_attention_ref(
        q, k_cache, v_cache, tables, torch.tensor([ctx]), torch.tensor([0, n]), head_dim**-0.5, window
    )
    slots = (tables[0, : -(-ctx // page), None].long() * page + torch.arange(page)).flatten()[:ctx]
    k = k_cache.view(-1, n_kv, head_dim)[slots].repeat_interleave(n_q // n_kv, 1)  # [ctx, Hq, D]
    v = v_cache.view(-1, n_kv, head_dim)[slots].repeat_interleave(n_q // n_kv, 1)
    seen = sliding_window_causal_mask_function(window)  # called on broadcast index tensors, as transformers does
    mask = seen(0, 0, torch.arange(ctx - n, ctx)[:, None], torch.arange(ctx)[None, :])
    scores = torch.einsum("ihd,jhd->hij", q, k) * head_dim**-0.5
    p = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    assert rel_err(ref, torch.einsum("hij,jhd->ihd", p, v)) < FP32_TOL


def test_write_kv(lib):
    k, v = torch.randn(6, 3, 8), torch.randn(6, 3, 8)
    slots = torch.tensor([5, -1, 0, 17, 9, -1])
    ours = [torch.full((5, 4, 3, 8), float("nan")) for _ in range(2)]
    ref = [c.clone() for c in ours]
    ops_cpu.write_kv_cpu(k, v, *ours, slots, lib)
    write_kv_ref(k, v, *ref, slots)
    assert all(torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(ours, ref, strict=True))


FALLBACK = """
import torch
from llamaterm.kernels.linear import linear, linear_ref
from tests.support.kernel_cases import random_qweight
w = random_qweight(33, 64, 4, 32, True, False, device="cpu")
x = torch.randn(2, 64)
assert torch.equal(linear(x, w), linear_ref(x, w))
linear(x, w)
"""


@pytest.mark.slow  # a fresh interpreter each (run_python)
@pytest.mark.parametrize(
    "env,why",
    [
        ({"CC": "/nonexistent/cc"}, "no C compiler found (/nonexistent/cc)"),
        ({"LLAMATERM_KERNELS": "torch"}, "LLAMATERM_KERNELS=torch"),
    ],
)
def test_fallback_says_why_once(env, why):
    """Without the native kernels the references answer, and one line says why, once per process."""
    assert run_python(FALLBACK, env) == [f"llamaterm: {why}: using the slower torch kernels on the CPU"]


ONE_CORE = """
import torch
from llamaterm.kernels.linear import linear_ref
from llamaterm.kernels.ops_cpu import qmatmul_cpu
from llamaterm.kernels.cpu_native import library
from tests.support.kernel_cases import random_qweight, rel_err
w = random_qweight(300, 64, 4, 32, True, False, device="cpu")
x = torch.randn(1, 64)
assert rel_err(qmatmul_cpu(x, w, library()), linear_ref(x, w)) < 1e-6
library()
"""


@pytest.mark.slow  # a fresh interpreter (run_python)
def test_one_core_says_so_once():
    """A process pinned to one core runs the kernels on its own thread, and says so once."""
    lines = run_python(ONE_CORE, {}, cores={min(os.sched_getaffinity(0))})
    assert lines == ["llamaterm: this process may use only 1 CPU core: the CPU kernels run on one thread (slower)"]


def run_python(code: str, env: dict, cores: set[int] | None = None) -> list[str]:
    """Runs `code` in a fresh interpreter (on `cores` only, if given); returns its stderr lines."""
    r = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None,
    )
    assert r.returncode == 0, r.stderr
    return r.stderr.splitlines()
