"""The routed experts' Triton kernels (kernels/moe_triton.py) against kernels/moe.py's torch references, at small
odd shapes: every weight format, split gate and up, biases, every activation, steps of 1 to 33 rows, experts no
row chose, rows that all choose the same experts, and a row's result alone and in a batch. Without CUDA they run
under TRITON_INTERPRET=1 (tests/conftest.py); every buffer the kernels allocate starts as NaN (`poisoned`)."""

import pytest
import torch

pytest.importorskip("triton")

from llamaterm.kernels.activation import ACTIVATIONS  # noqa: E402
from llamaterm.kernels.moe import Experts, moe_ref, route_ref  # noqa: E402
from llamaterm.kernels.moe_triton import MoeConfig, align, moe_triton, pick_config, route_triton  # noqa: E402
from llamaterm.kernels.qweight import QuantWeight  # noqa: E402
from tests.support.kernel_cases import DEVICE, random_mxfp4, random_qweight, rel_err  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("poisoned")]

# bf16 on the CPU: the interpreter rounds fp32 to bf16 toward zero (the GPU to nearest), and the experts round as
# the reference does, five times in a row (gate, up, act * up, y, y + bias): about 2% off, all one way
TOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2 if torch.cuda.is_available() else 4e-2}
E, H, INTER = 6, 96, 48  # K = 96: a step and a half of 4-bit group 32; I = 48 leaves a short last group of 32

# (bits, group, offsets) of quantized experts; "mxfp4"; or a dtype: dense experts
FORMATS = [(4, 32, True), (4, 32, False), (8, 16, False), (4, 128, False), (8, 32, True), (4, 16, True), "mxfp4"]


def weight(n: int, k: int, fmt) -> torch.Tensor | QuantWeight:
    """A random weight [n, k] whose products with N(0, 1) inputs are about 1."""
    if fmt == "mxfp4":
        return random_mxfp4(n, k, exponents=(-7, -4))
    if isinstance(fmt, torch.dtype):
        return (torch.randn(n, k, device=DEVICE) * k**-0.5).to(fmt)
    bits, group, offsets = fmt
    w = random_qweight(n, k, bits, group, offsets, False, scale_dtype=torch.float16 if bits == 4 else torch.float32)
    w.scales = w.scales / 2 ** (bits - 4)  # 8-bit codes span 16 times 4-bit ones
    if offsets:  # about -scale * 2**(bits - 1), as affine formats' zero points centre the codes
        w.offsets = (w.offsets.float() - w.scales.float() * 2 ** (bits - 1)).to(w.scales.dtype)
    return w


def random_experts(gate_up_fmt, down_fmt=None, split=False, biases=False, activation="silu", n_experts=E):
    down_fmt = gate_up_fmt if down_fmt is None else down_fmt
    gate_up = (
        [weight(n_experts * INTER, H, gate_up_fmt) for _ in range(2)]
        if split
        else [weight(n_experts * 2 * INTER, H, gate_up_fmt)]
    )
    return Experts(
        n_experts,
        gate_up,
        weight(n_experts * H, INTER, down_fmt),
        activation,
        torch.randn(n_experts, 2 * INTER, device=DEVICE) if biases else None,
        torch.randn(n_experts, H, device=DEVICE) if biases else None,
    )


def reference(x, weights, ids, experts):
    """moe_ref in fp32 (dense experts' weights made fp32 too)."""
    as_fp32 = lambda w: w.float() if isinstance(w, torch.Tensor) else w  # noqa: E731
    fp32 = Experts(
        experts.n_experts,
        [as_fp32(w) for w in experts.gate_up],
        as_fp32(experts.down),
        experts.activation,
        experts.gate_up_bias,
        experts.down_bias,
    )
    return moe_ref(x.float(), weights, ids, fp32)


def step(m: int, top_k: int = 2, n_experts: int = E, dtype=torch.float16):
    x = torch.randn(m, H, device=DEVICE).to(dtype)
    weights, ids = route_ref(torch.randn(m, n_experts, device=DEVICE), top_k, True)
    return x, weights, ids


@pytest.mark.parametrize("n_experts,top_k", [(6, 2), (32, 4), (128, 8), (60, 1)])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("m", [1, 3, 33])
def test_route(n_experts, top_k, renormalize, m):
    logits = torch.randn(m, n_experts, device=DEVICE) * 3
    weights, ids = route_triton(logits, top_k, renormalize)
    want_weights, want_ids = route_ref(logits, top_k, renormalize)
    assert torch.equal(ids, want_ids)
    assert rel_err(weights, want_weights) < 1e-6


@pytest.mark.parametrize(
    "m,top_k,n_experts,block_m", [(1, 2, 6, 8), (33, 3, 6, 8), (33, 2, 6, 16), (40, 4, 32, 8), (300, 4, 32, 64)]
)
def test_align(m, top_k, n_experts, block_m):
    """Each expert's pairs in order, at whole tiles in expert order, the rest of its last tile padded with P (no
    pair); every tile's expert, -1 past the last (the grid is fixed by M, k and E). 1200 pairs: two chunks."""
    ids = route_ref(torch.randn(m, n_experts, device=DEVICE), top_k, True)[1]
    pairs, tile_expert = align(ids, n_experts, block_m)
    p = ids.numel()
    flat = ids.flatten().cpu()
    want_pairs, want_experts = [], []
    for e in range(n_experts):
        mine = torch.nonzero(flat == e).flatten().tolist()
        tiles = -(-len(mine) // block_m)
        want_pairs += mine + [p] * (tiles * block_m - len(mine))
        want_experts += [e] * tiles
    n = len(want_experts)
    assert tile_expert.numel() == -(-p // block_m) + min(n_experts, p)
    assert tile_expert.cpu().tolist() == want_experts + [-1] * (tile_expert.numel() - n)
    assert pairs[: n * block_m].cpu().tolist() == want_pairs


@pytest.mark.parametrize("fmt", [*FORMATS, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_moe_formats(fmt, dtype):
    experts = random_experts(fmt)
    x, weights, ids = step(5, dtype=dtype)
    assert rel_err(moe_triton(x, weights, ids, experts), reference(x, weights, ids, experts)) < TOL[dtype]


@pytest.mark.parametrize("m,n_experts,top_k", [(1, 6, 2), (3, 6, 2), (8, 6, 2), (33, 6, 2), (1, 16, 3), (4, 16, 3)])
def test_moe_rows(m, n_experts, top_k):
    """Qwen3-MoE's formats (Q4_K-like gate_up, Q6_K-like 8-bit down); with 16 experts a small step leaves most
    of them unchosen."""
    experts = random_experts((4, 32, True), (8, 16, False), n_experts=n_experts)
    x, weights, ids = step(m, top_k, n_experts)
    want = reference(x, weights, ids, experts)
    out = moe_triton(x, weights, ids, experts)
    assert rel_err(out, want) < TOL[torch.float16]
    assert torch.equal(moe_triton(x, weights, ids, experts), out)  # the counters were reset; no order dependence


@pytest.mark.parametrize("m", [8, 33])
def test_moe_rows_that_choose_the_same_experts(m):
    """Every row routes to the same experts: each gets every row, several tiles of pairs."""
    experts = random_experts((4, 32, True), (8, 16, False))
    x = torch.randn(m, H, device=DEVICE).half()
    weights, ids = route_ref(torch.randn(1, E, device=DEVICE).expand(m, E), 2, True)
    assert rel_err(moe_triton(x, weights, ids, experts), reference(x, weights, ids, experts)) < TOL[torch.float16]


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("fmt", [(4, 32, True), "mxfp4", torch.bfloat16])
@pytest.mark.parametrize("split", [False, True])
def test_moe_activations_biases_and_split_gate_up(activation, fmt, split):
    """gpt-oss's experts: MXFP4 with biases and its clamped SwiGLU; and every activation with gate and up as one
    stacked weight or two."""
    experts = random_experts(fmt, split=split, biases=True, activation=activation)
    x, weights, ids = step(7, 4, dtype=torch.bfloat16)
    want = reference(x, weights, ids, experts)
    assert rel_err(moe_triton(x, weights, ids, experts), want) < TOL[torch.bfloat16]


@pytest.mark.parametrize(
    "config", [MoeConfig(8, 16, 32, 4, 2), MoeConfig(16, 32, 64, 4, 2), MoeConfig(32, 16, 32, 4, 1)]
)
def test_moe_tiles(config):
    """Tiles of 8, 16 and 32 pairs, feature tiles that do not divide I or H."""
    experts = random_experts((4, 32, True), (8, 16, False), biases=True)
    x, weights, ids = step(21, 3)
    want = reference(x, weights, ids, experts)
    assert rel_err(moe_triton(x, weights, ids, experts, config), want) < TOL[torch.float16]


def test_moe_row_alone_and_in_a_batch():
    """Each row of an 8-row step gives bit for bit what it gives alone (one tile config for both, sums in slot
    order): the batch does not change a sequence's results."""
    experts = random_experts("mxfp4", (8, 16, False), biases=True)
    x, weights, ids = step(8)
    assert pick_config(ids.numel(), E) == pick_config(2, E)
    batch = moe_triton(x, weights, ids, experts)
    for r in range(8):
        alone = moe_triton(x[r : r + 1], weights[r : r + 1], ids[r : r + 1], experts)
        assert torch.equal(alone, batch[r : r + 1])
