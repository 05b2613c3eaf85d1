"""The safetensors loader, each format against an independent oracle: transformers' own state dict (dense),
checkpoints packed here by the published GPTQ / AWQ layouts with a per-element dequantization formula, and
transformers' llama3 RoPE frequencies."""

import json

import pytest
import torch
import transformers
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from llamaterm.engine.api import EngineConfig
from llamaterm.engine.checkpoints.hf_config import model_config
from llamaterm.engine.checkpoints.safetensors_loader import load_safetensors
from llamaterm.engine.errors import ModelFormatError
from llamaterm.engine.serving.engine import Engine
from llamaterm.kernels.linear import linear_ref
from llamaterm.kernels.qweight import QuantWeight
from tests.support.engine_checks import greedy, our_last_logits
from tests.support.family_oracle import byte_level_bpe, hf_greedy, hf_logits
from tests.support.safetensors_files import FFN, HIDDEN, LAYERS, LINEARS, VOCAB, config_json, gguf_name, write_dense

# --- dense: a tiny random transformers model -------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, tied, max_shard_size",
    [(torch.float16, False, None), (torch.bfloat16, True, "20KB"), (torch.float32, False, "100KB")],
)
def test_dense_matches_transformers_state_dict(tmp_path, dtype, tied, max_shard_size):
    torch.manual_seed(0)
    hf_config = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=100,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
    )
    model = LlamaForCausalLM(hf_config).to(dtype)
    for p in model.parameters():  # norms start at exactly 1: randomize them so a swapped name would show
        p.data.normal_()
    model.save_pretrained(tmp_path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    assert (tmp_path / "model.safetensors.index.json").exists() == (max_shard_size is not None)

    ckpt = load_safetensors(tmp_path)

    state = model.state_dict()
    expected = {gguf_name(k): v for k, v in state.items() if not (tied and k == "lm_head.weight")}
    assert set(ckpt.tensors) == set(expected)
    for name, want in expected.items():
        got = ckpt.tensors[name]
        assert isinstance(got, torch.Tensor) and got.dtype == dtype, name
        assert torch.equal(got, want), name
    c = ckpt.config
    assert (c.arch, c.n_layers, c.hidden_size, c.intermediate_size, c.n_heads, c.n_kv_heads, c.head_dim) == (
        "llama",
        2,
        64,
        128,
        4,
        2,
        16,
    )
    assert (c.vocab_size, c.context_length, c.rms_norm_eps, c.tie_word_embeddings) == (100, 512, 1e-5, tied)
    assert c.rope_theta == hf_config.rope_parameters["rope_theta"] and c.rope_freq_factors is None
    assert ckpt.path == tmp_path


# --- GPTQ and AWQ: checkpoints packed here ---------------------------------------------------------------

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble i of a word holds output column 8c + AWQ_ORDER[i]


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words (held in int64) -> the int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_gptq_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """[R * 32/bits, C] -> int32 [R, C]: word [r, c] holds rows r*(32/bits) + j at bit bits*j (qweight)."""
    per = 32 // bits
    v = q.long().view(-1, per, q.shape[1])
    return to_int32(sum(v[:, j] << (bits * j) for j in range(per)))


def pack_gptq_cols(z: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C * 32/bits] -> int32 [R, C]: word [r, c] holds columns c*(32/bits) + j at bit bits*j (qzeros)."""
    per = 32 // bits
    v = z.long().view(z.shape[0], -1, per)
    return to_int32(sum(v[..., j] << (bits * j) for j in range(per)))


def pack_awq(q: torch.Tensor) -> torch.Tensor:
    """[R, C*8] -> int32 [R, C]: nibble i of word [r, c] holds column 8c + AWQ_ORDER[i]."""
    v = q.long().view(q.shape[0], -1, 8)
    return to_int32(sum(v[..., AWQ_ORDER[i]] << (4 * i) for i in range(8)))


def make_gptq(n, k, bits, group_size, sym, desc_act, fmt, gen):
    """Random GPTQ tensors for one linear, the oracle weight [n, k] and its per-element error bound."""
    gs = k if group_size == -1 else group_size
    groups = -(-k // gs)  # the last one short where gs does not divide k (GPTQModel's 576 in groups of 128)
    q = torch.randint(0, 2**bits, (k, n), generator=gen)
    shift = 1 if fmt == "gptq" else 0  # v1 stores zero - 1
    stored = (
        torch.full((groups, n), 2 ** (bits - 1) - shift)
        if sym
        else torch.randint(0, 2**bits, (groups, n), generator=gen)
    )
    scales = (torch.rand(groups, n, generator=gen) * 0.02 + 0.001).half()
    g_idx = torch.arange(k) // gs
    if desc_act:  # channel c is the rank(c)-th processed; groups follow processing order
        order = torch.randperm(k, generator=gen)
        g_idx = torch.empty(k, dtype=torch.long)
        g_idx[order] = torch.arange(k) // gs
    parts = {
        "qweight": pack_gptq_rows(q, bits),
        "qzeros": pack_gptq_cols(stored, bits),
        "scales": scales,
        "g_idx": g_idx.int(),
    }
    w = torch.empty(n, k)
    zero = stored + shift
    for c in range(k):  # w[n, c] = scale[g_idx[c], n] * (q[c, n] - zero[g_idx[c], n])
        g = g_idx[c]
        w[:, c] = scales[g].float() * (q[c] - zero[g])
    bound = torch.zeros(n, k) if sym else 2.0**-11 * (scales.float() * zero)[g_idx].T.abs()
    return parts, w, bound


def make_awq(n, k, group_size, sym, gen):
    groups = -(-k // group_size)
    q = torch.randint(0, 16, (k, n), generator=gen)
    zero = torch.full((groups, n), 8) if sym else torch.randint(0, 16, (groups, n), generator=gen)
    scales = (torch.rand(groups, n, generator=gen) * 0.02 + 0.001).half()
    parts = {"qweight": pack_awq(q), "qzeros": pack_awq(zero), "scales": scales}
    w = torch.empty(n, k)
    for c in range(k):  # w[n, c] = scale[c // gs, n] * (q[c, n] - zero[c // gs, n])
        w[:, c] = scales[c // group_size].float() * (q[c] - zero[c // group_size])
    group_bound = 2.0**-11 * scales.float() * zero
    bound = torch.zeros(n, k) if sym else group_bound.repeat_interleave(group_size, 0)[:k].T
    return parts, w, bound


def write_quantized(path, quantization_config, make_linear, bias=False):
    """A 2-layer checkpoint with quantized linears and fp16 embedding / norms / lm_head, plus the oracle."""
    gen = torch.Generator().manual_seed(0)
    dense = {
        "model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=gen).half(),
        "model.norm.weight": torch.randn(HIDDEN, generator=gen).half(),
        "lm_head.weight": torch.randn(VOCAB, HIDDEN, generator=gen).half(),
    }
    tensors, oracle = dict(dense), {}
    for i in range(LAYERS):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            dense[f"model.layers.{i}.{norm}.weight"] = torch.randn(HIDDEN, generator=gen).half()
        for module, (n, k) in LINEARS.items():
            parts, w, bound = make_linear(n, k, gen)
            if bias and module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                dense[f"model.layers.{i}.{module}.bias"] = torch.randn(n, generator=gen).half()
            tensors.update({f"model.layers.{i}.{module}.{p}": t for p, t in parts.items()})
            oracle[gguf_name(f"model.layers.{i}.{module}.weight")] = (w, bound)
    tensors.update(dense)
    save_file(tensors, path / "model.safetensors")
    hf_config = config_json(quantization_config=quantization_config, attention_bias=bias)
    (path / "config.json").write_text(json.dumps(hf_config))
    return {gguf_name(k): v for k, v in dense.items()}, oracle


def check_quantized(ckpt, dense, oracle, bits, group_size, symmetric, act_order=False):
    assert set(ckpt.tensors) == set(dense) | set(oracle)
    for name, want in dense.items():
        got = ckpt.tensors[name]
        assert isinstance(got, torch.Tensor) and got.dtype == torch.float16 and torch.equal(got, want), name
    x = torch.randn(3, FFN, generator=torch.Generator().manual_seed(1))
    for name, (w, bound) in oracle.items():
        qw = ckpt.tensors[name]
        n, k = w.shape
        assert isinstance(qw, QuantWeight), name
        assert (qw.bits, qw.group_size, qw.shape, qw.scales.dtype) == (
            bits,
            k if group_size == -1 else group_size,
            (n, k),
            torch.float16,
        )
        assert (qw.offsets is None) == symmetric and (qw.perm is not None) == act_order, name
        perm = torch.arange(k) if qw.perm is None else qw.perm
        assert torch.equal(perm.sort().values, torch.arange(k)), name
        # Stored columns are the original ones in `perm` order; fp16 offsets cost at most 2**-11 relative.
        err = (qw.dequantize() - w[:, perm]).abs()
        assert (err <= bound[:, perm]).all(), f"{name}: max error {err.max()}"
        xk = x[:, :k]
        tol = xk.abs() @ (bound + 1e-6 * w.abs()).T
        assert ((linear_ref(xk, qw) - xk @ w.T).abs() <= tol).all(), name


GPTQ_CASES = [  # bits, group_size, sym, desc_act, checkpoint_format
    pytest.param(4, 128, True, False, "gptq", id="4bit-g128-sym"),
    pytest.param(4, 32, False, False, "gptq", id="4bit-g32-asym"),
    pytest.param(8, 64, False, False, "gptq", id="8bit-g64-asym"),
    pytest.param(8, 32, True, True, "gptq", id="8bit-g32-sym-desc_act"),
    pytest.param(4, 32, False, True, "gptq", id="4bit-g32-asym-desc_act"),
    pytest.param(4, -1, True, False, "gptq", id="4bit-per-channel-sym"),
    pytest.param(4, 64, False, False, "gptq_v2", id="4bit-g64-asym-v2"),
    # groups of 48: the 128 and 256 inputs end in short groups of 32 and 16 (GPTQModel writes such checkpoints)
    pytest.param(4, 48, False, False, "gptq", id="4bit-g48-asym-short-last-group"),
    pytest.param(8, 48, True, True, "gptq_v2", id="8bit-g48-sym-desc_act-short-last-group"),
]


@pytest.mark.parametrize("bits, group_size, sym, desc_act, fmt", GPTQ_CASES)
def test_gptq_matches_per_element_dequantization(tmp_path, bits, group_size, sym, desc_act, fmt):
    qc = {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group_size,
        "sym": sym,
        "desc_act": desc_act,
        "checkpoint_format": fmt,
    }
    make = lambda n, k, gen: make_gptq(n, k, bits, group_size, sym, desc_act, fmt, gen)
    dense, oracle = write_quantized(tmp_path, qc, make, bias=not sym)
    ckpt = load_safetensors(tmp_path)
    check_quantized(ckpt, dense, oracle, bits, group_size, sym, act_order=desc_act and group_size != -1)


@pytest.mark.parametrize(
    "group_size, sym, qc_keys",
    [
        (128, False, ("bits", "group_size")),
        (32, False, ("w_bit", "q_group_size")),  # AutoAWQ's spelling
        (64, True, ("bits", "group_size")),
        (48, False, ("bits", "group_size")),  # a short last group
    ],
)
def test_awq_matches_per_element_dequantization(tmp_path, group_size, sym, qc_keys):
    qc = {"quant_method": "awq", qc_keys[0]: 4, qc_keys[1]: group_size, "zero_point": True, "version": "GEMM"}
    dense, oracle = write_quantized(tmp_path, qc, lambda n, k, gen: make_awq(n, k, group_size, sym, gen))
    ckpt = load_safetensors(tmp_path)
    check_quantized(ckpt, dense, oracle, 4, group_size, sym)


def test_gptq_with_short_last_groups_runs_like_transformers(tmp_path):
    """SmolLM2-135M's widths (576 = 4.5 groups of 128, as GPTQModel writes it) in one layer, symmetric (exact:
    asymmetric offsets are rounded to fp16, see quant_weight) with act-order: transformers on the per-element
    dequantized weights gives the same logits (fp32, 1e-4 of their range) and greedy tokens."""
    hf_config = LlamaConfig(
        vocab_size=384,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=1,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(hf_config).eval()
    gen = torch.Generator().manual_seed(0)
    state, tensors = model.state_dict(), {}
    for name, t in state.items():
        if name.endswith("_proj.weight"):
            parts, state[name], _ = make_gptq(*t.shape, 4, 128, True, True, "gptq", gen)
            tensors |= {f"{name.removesuffix('.weight')}.{p}": v for p, v in parts.items()}
        else:
            tensors[name] = t.normal_(1.0 if t.dim() == 1 else 0.0, 0.2 if t.dim() == 1 else 0.05)
    model.load_state_dict(state)
    save_file(tensors, tmp_path / "model.safetensors")
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": True}
    (tmp_path / "config.json").write_text(
        json.dumps(hf_config.to_dict() | {"architectures": ["LlamaForCausalLM"], "quantization_config": qc})
    )
    byte_level_bpe(tmp_path, 384, ["<|im_start|>", "<|im_end|>"])
    prompt = [5, 17, 200, 33, 99, 1, 250, 7, 64, 128, 300, 12]
    engine = Engine.from_model(EngineConfig(model=str(tmp_path), device="cpu", kv_tokens=512))
    try:
        o = engine.core.model.layers[0].o
        assert o.group_size == 128 and o.scales.shape == (576, 5)
        want = hf_logits(model, prompt)[-1]
        assert (our_last_logits(engine, prompt) - want).abs().max() <= 1e-4 * (want.max() - want.min())
        assert greedy(engine, prompt, 16) == hf_greedy(model, prompt, 16)
    finally:
        engine.shutdown()


# --- RoPE scaling ----------------------------------------------------------------------------------------

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize("head_dim, factor", [(128, 8.0), (64, 32.0)], ids=["llama-3.1", "llama-3.2-1b"])
@pytest.mark.parametrize("style", ["rope_scaling", "rope_parameters"])
def test_llama3_rope_factors_match_transformers(head_dim, factor, style):
    scaling = {**LLAMA3_SCALING, "factor": factor}
    hf_config = LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        max_position_embeddings=131072,
        rope_parameters={**scaling, "rope_theta": 500000.0},
    )
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    if style == "rope_scaling":  # the config.json of the Llama 3.x repos (transformers 4)
        hf = hf_config.to_dict() | {"rope_parameters": None, "rope_theta": 500000.0, "rope_scaling": scaling}
    else:  # what transformers 5 writes
        hf = hf_config.to_dict() | {"architectures": ["LlamaForCausalLM"]}
    config = model_config(hf, "llama3")
    assert config.rope_theta == 500000.0 and len(config.rope_freq_factors) == head_dim // 2
    torch.testing.assert_close(config.inv_freq(), want, rtol=1e-6, atol=0)


# --- bad input -------------------------------------------------------------------------------------------


def test_writers_produce_a_loadable_checkpoint(tmp_path):
    raw = write_dense(tmp_path)
    assert set(load_safetensors(tmp_path).tensors) == {gguf_name(k) for k in raw}


def test_missing_config_json(tmp_path):
    write_dense(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(ModelFormatError, match="no config.json"):
        load_safetensors(tmp_path)


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next"},
            r"Qwen3-Next .*'Qwen3NextForCausalLM'.* is "
            r"not supported \(llamaterm runs: .*\(qwen2\)",
        ),
        ({"architectures": ["MambaForCausalLM"]}, "the architecture 'MambaForCausalLM' is not supported"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "dynamic"),
        ({"quantization_config": {"quant_method": "bitsandbytes"}}, "bitsandbytes"),
        (
            {
                "quantization_config": {
                    "quant_method": "gptq",
                    "bits": 4,
                    "group_size": 128,
                    "checkpoint_format": "marlin",
                }
            },
            "marlin",
        ),
    ],
)
def test_unsupported_config(tmp_path, extra, message):
    write_dense(tmp_path, **extra)
    with pytest.raises(ModelFormatError, match=message):
        load_safetensors(tmp_path)


def test_mistral_without_sliding_window_loads(tmp_path):
    write_dense(tmp_path, architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None)
    config = load_safetensors(tmp_path).config
    assert config.arch == "llama" and config.sliding_window is None and config.kv_window() is None


def test_sliding_window_is_read_as_transformers_reads_it(tmp_path):
    """Absent: MistralConfig's and MinistralConfig's default; Llama ignores the key; Ministral's layer_types."""
    base = config_json() | {"max_position_embeddings": 32768}
    mistral = base | {"architectures": ["MistralForCausalLM"], "model_type": "mistral"}
    assert model_config(mistral, "m").sliding_window == transformers.MistralConfig().sliding_window == 4096
    assert model_config(mistral | {"sliding_window": 64}, "m").kv_window() == 64
    assert model_config(base | {"sliding_window": 64}, "llama").kv_window() is None
    ministral = base | {
        "architectures": ["MinistralForCausalLM"],
        "model_type": "ministral",
        "sliding_window": 64,
        "layer_types": ["full_attention", "sliding_attention"],
    }
    config = model_config(ministral, "m")
    assert [config.layer_window(i) for i in range(LAYERS)] == [None, 64] and config.kv_window() is None


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"sliding_window": 0}, "sliding_window = 0 is not a positive integer"),
        ({"sliding_window": -4096}, "sliding_window = -4096 is not a positive integer"),
        ({"sliding_window": "4096"}, "sliding_window = '4096' is not a positive integer"),
        ({"layer_types": ["sliding_attention"]}, "layer_types must give one of"),
        ({"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types must give one of"),
    ],
)
def test_bad_sliding_window_config(tmp_path, extra, message):
    write_dense(tmp_path, architectures=["MinistralForCausalLM"], model_type="ministral", **extra)
    with pytest.raises(ModelFormatError, match=message):
        load_safetensors(tmp_path)


def test_mistral_config_missing_a_field_it_needs(tmp_path):
    write_dense(
        tmp_path,
        architectures=["MistralForCausalLM"],
        model_type="mistral",
        num_key_value_heads=None,
        num_hidden_layers=None,
    )
    with pytest.raises(ModelFormatError, match="config.json: num_hidden_layers is missing"):
        load_safetensors(tmp_path)


def test_pickle_weights_are_refused_unread(tmp_path, monkeypatch):
    torch.save({"model.embed_tokens.weight": torch.zeros(2, 2)}, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(json.dumps(config_json()))

    def no_unpickling(*args, **kwargs):
        raise AssertionError("torch.load must not be called")

    monkeypatch.setattr(torch, "load", no_unpickling)
    with pytest.raises(ModelFormatError, match="pickle"):
        load_safetensors(tmp_path)


def test_truncated_safetensors_file(tmp_path):
    write_dense(tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ModelFormatError, match="corrupt or truncated"):
        load_safetensors(tmp_path)


def test_shape_mismatch(tmp_path):
    write_dense(tmp_path, intermediate_size=2 * FFN)
    with pytest.raises(ModelFormatError, match=r"mlp\.\w+_proj\.weight has shape"):
        load_safetensors(tmp_path)


def test_quantized_shape_mismatch(tmp_path):
    # 4-bit tensors under a config that says 8 bits: qweight holds half the rows 8-bit needs.
    write_quantized(
        tmp_path,
        {"quant_method": "gptq", "bits": 4, "group_size": 32},
        lambda n, k, gen: make_gptq(n, k, 4, 32, False, False, "gptq", gen),
    )
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["bits"] = 8
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFormatError, match=r"proj\.qweight has shape \[\d+, \d+\], expected"):
        load_safetensors(tmp_path)


def test_inconsistent_g_idx(tmp_path):
    def make(n, k, gen):
        parts, w, bound = make_gptq(n, k, 4, 32, True, False, "gptq", gen)
        parts["g_idx"][0] = 1  # group 0 short of a channel, group 1 over
        return parts, w, bound

    write_quantized(tmp_path, {"quant_method": "gptq", "bits": 4, "group_size": 32}, make)
    with pytest.raises(ModelFormatError, match="g_idx"):
        load_safetensors(tmp_path)


def test_missing_and_unexpected_tensors(tmp_path):
    raw = write_dense(tmp_path)
    del raw["model.layers.1.mlp.down_proj.weight"]
    save_file(raw, tmp_path / "model.safetensors")
    with pytest.raises(ModelFormatError, match=r"lacks tensors for \['blk.1.ffn_down'\]"):
        load_safetensors(tmp_path)
    raw["model.layers.1.mlp.down_proj.q_weight"] = torch.zeros(HIDDEN, FFN)  # an EXL2-style name
    save_file(raw, tmp_path / "model.safetensors")
    with pytest.raises(ModelFormatError, match="unexpected tensor"):
        load_safetensors(tmp_path)


def test_index_naming_a_missing_shard(tmp_path):
    raw = write_dense(tmp_path)
    weight_map = {name: "model.safetensors" for name in raw} | {"lm_head.weight": "model-00002.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelFormatError, match="model-00002.safetensors .* missing"):
        load_safetensors(tmp_path)
