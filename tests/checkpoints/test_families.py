"""Each model family against transformers: a tiny random model built with transformers' own class, loaded from
safetensors (same logits within 1e-4 of their range, same greedy tokens) and converted to GGUF by llama.cpp's
converter (same greedy tokens). tests/support/family_oracle.py builds the models and runs the oracles."""

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import tokenizers
import torch
import transformers
from gguf import GGUFValueType, GGUFWriter

from llamaterm.engine.api import EngineConfig
from llamaterm.engine.checkpoints.architectures import FAMILIES as SUPPORTED
from llamaterm.engine.checkpoints.architectures import REFUSED
from llamaterm.engine.checkpoints.checkpoint_info import read_checkpoint
from llamaterm.engine.checkpoints.gguf import _config as gguf_config
from llamaterm.engine.checkpoints.gguf import load_gguf, read_gguf_file
from llamaterm.engine.checkpoints.hf_config import model_config
from llamaterm.engine.checkpoints.tokenizer import Tokenizer
from llamaterm.engine.errors import ModelFormatError
from llamaterm.engine.sampling_params import SamplingParams
from llamaterm.engine.serving.engine import Engine
from llamaterm.kernels.qweight import QuantWeight
from tests.support.cli import llamaterm
from tests.support.engine_checks import assert_greedy_choices, assert_same_until_near_tie, greedy, our_last_logits
from tests.support.family_oracle import (
    byte_level_bpe,
    convert_to_gguf,
    gpt_oss_mxfp4,
    hf_greedy,
    hf_logits,
    rewrite_gguf,
    save_tiny_model,
)

pytestmark = pytest.mark.slow  # each family's model built by transformers and converted by llama.cpp's converter

VOCAB = 384
PROMPT = [5, 17, 200, 33, 99, 1, 250, 7, 64, 128, 300, 12, 45, 46, 47, 48, 301, 2, 9]
GREEDY_STEPS = 24


@dataclass
class Family:
    model_cls: type
    config: transformers.PretrainedConfig
    pre: str  # the GGUF pre-tokenizer llama.cpp's converter would detect for the family's real tokenizer
    pre_split: str | None = None  # the family's pre-tokenizer regex, for the test tokenizer
    tokenizer_class: str = "PreTrainedTokenizerFast"  # as the family's tokenizer_config.json names it
    unused_tokens: bool = False  # <unusedN> tokens fill the vocabulary, as in Gemma's
    needs_tensor: str = "blk.1.ffn_down.weight"  # a GGUF tensor without which the family's model does not load
    needs_key: str = "num_hidden_layers"  # a config.json key (a.b: b in object a) without which it does not load
    # transformers' GGUF reader reads the family back (a check of the converter); where it does not, why
    hf_misreads_gguf: str | None = None
    prompt: list[int] = field(default_factory=lambda: PROMPT)
    gguf_window: bool = False  # have llama.cpp's converter write the sliding window it leaves out for the family


def small(**kw) -> dict:
    """Shapes shared by every tiny family model: GQA, 2 layers, head_dim 16, a vocabulary of VOCAB."""
    return dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        **kw,
    )


LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)  # Llama 3's tokenizer.json
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)  # Qwen2.5's tokenizer.json

GPT4O_SPLIT = (  # Phi-4-mini's tokenizer.json (o200k)
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# transformers' GGUF loader maps no LongRoPE keys or factor tensors for phi3: it rebuilds the model with plain RoPE
PHI3_GGUF_IN_TRANSFORMERS = "transformers reads phi3 GGUFs without their rope_factors_long/short (plain RoPE)"
# nor the experts' sizes and counts of a mixture: it rebuilds the model with its config class's defaults
MOE_GGUF_IN_TRANSFORMERS = "transformers reads MoE GGUFs with its config's default expert sizes and counts"

FAMILIES = {
    "llama": Family(
        transformers.LlamaForCausalLM,
        transformers.LlamaConfig(**small(tie_word_embeddings=False)),
        "llama-bpe",
        LLAMA3_SPLIT,
    ),
    # Qwen2.5-0.5B / 1.5B / 3B tie their embeddings, 7B does not; q/k/v biases either way
    "qwen2": Family(
        transformers.Qwen2ForCausalLM,
        transformers.Qwen2Config(**small(tie_word_embeddings=True)),
        "qwen2",
        QWEN2_SPLIT,
        needs_tensor="blk.0.attn_v.bias",
    ),
    "qwen2-untied": Family(
        transformers.Qwen2ForCausalLM,
        transformers.Qwen2Config(**small(tie_word_embeddings=False, rope_theta=1e6)),
        "qwen2",
        QWEN2_SPLIT,
    ),
    # Qwen3: head_dim from the config, 128 as in every Qwen3 (0.6B: 1024 / 16 heads would give 64); transformers'
    # GGUF reader assumes 128, so its check of the converter's output holds only there
    "qwen3": Family(
        transformers.Qwen3ForCausalLM,
        transformers.Qwen3Config(**small(tie_word_embeddings=True) | dict(head_dim=128, rope_theta=1e6)),
        "qwen2",
        QWEN2_SPLIT,
        needs_tensor="blk.1.attn_k_norm.weight",
        needs_key="head_dim",
    ),
    # Phi-4-mini: LongRoPE on 3/4 of each head (its tokenizer is o200k's, GPT2Tokenizer with the gpt-4o split);
    # tied embeddings. The greedy runs stay within the original context (64 tokens, 4096 in Phi-3.5 and Phi-4-mini):
    # past it see test_longrope_past_the_original_context
    "phi3": Family(
        transformers.Phi3ForCausalLM,
        transformers.Phi3Config(
            **small(
                tie_word_embeddings=True,
                original_max_position_embeddings=64,
                partial_rotary_factor=0.75,
                rope_scaling={
                    "rope_type": "longrope",
                    "short_factor": [1.0 + i / 8 for i in range(6)],
                    "long_factor": [1.5 + i for i in range(6)],
                },
                pad_token_id=0,
                eos_token_id=1,
            )
        ),
        "gpt-4o",
        GPT4O_SPLIT,
        "GPT2Tokenizer",
        needs_tensor="blk.0.attn_qkv.weight",
        needs_key="rope_parameters.long_factor",
        hf_misreads_gguf=PHI3_GGUF_IN_TRANSFORMERS,
    ),
    # Phi-3.5-mini: LongRoPE on the whole head, untied
    "phi3-full-rotary": Family(
        transformers.Phi3ForCausalLM,
        transformers.Phi3Config(
            **small(
                tie_word_embeddings=False,
                original_max_position_embeddings=64,
                rope_scaling={
                    "rope_type": "longrope",
                    "short_factor": [1.0 + i / 16 for i in range(8)],
                    "long_factor": [2.0 + i / 2 for i in range(8)],
                },
                pad_token_id=0,
                eos_token_id=1,
            )
        ),
        "gpt-4o",
        GPT4O_SPLIT,
        "GPT2Tokenizer",
        hf_misreads_gguf=PHI3_GGUF_IN_TRANSFORMERS,
    ),
    # Gemma 3 (text): five sliding layers (window 8) and a global one, Gemma 3's pattern, which its GGUFs leave to
    # llama.cpp's default; a RoPE base per kind and linear scaling on the global layers (Gemma 3 4B+: x8); head_dim
    # 32 on hidden 64, q/k norms, (1 + weight) norms, GeGLU, a scaled embedding
    "gemma3": Family(
        transformers.Gemma3ForCausalLM,
        transformers.Gemma3TextConfig(
            **small(
                tie_word_embeddings=True,
                sliding_window=8,
                query_pre_attn_scalar=32,
                rope_parameters={
                    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                },
            )
            | dict(head_dim=32, num_hidden_layers=6)
        ),
        "llama-bpe",
        LLAMA3_SPLIT,
        unused_tokens=True,
        needs_tensor="blk.2.post_ffw_norm.weight",
        needs_key="query_pre_attn_scalar",
        hf_misreads_gguf="transformers rebuilds gemma3 GGUFs with other position settings than the converter wrote "
        "(their logits agree at the first position only)",
    ),
    # a window of 8, far shorter than the 19-token prompt and its 24 greedy tokens
    "mistral": Family(
        transformers.MistralForCausalLM,
        transformers.MistralConfig(**small(sliding_window=8)),
        "llama-bpe",
        LLAMA3_SPLIT,
        gguf_window=True,
    ),
    # Mixtures of experts, 8 experts (4 for Mixtral) of which 2 a token. Qwen3-MoE (Qwen3-30B-A3B's kind): q/k norms,
    # the chosen weights renormalised (norm_topk_prob, as every Qwen3-MoE has it)
    "qwen3moe": Family(
        transformers.Qwen3MoeForCausalLM,
        transformers.Qwen3MoeConfig(
            **small(tie_word_embeddings=False, rope_theta=1e6)
            | dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
        ),
        "qwen2",
        QWEN2_SPLIT,
        needs_tensor="blk.1.ffn_down_exps.weight",
        needs_key="num_experts_per_tok",
        hf_misreads_gguf=MOE_GGUF_IN_TRANSFORMERS,
    ),
    # Qwen2-MoE (Qwen1.5-MoE): q/k/v biases, the chosen weights as the softmax gives them, and a shared expert with
    # its own sigmoid gate
    "qwen2moe": Family(
        transformers.Qwen2MoeForCausalLM,
        transformers.Qwen2MoeConfig(
            **small(tie_word_embeddings=False)
            | dict(
                num_experts=8,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=48,
                norm_topk_prob=False,
            )
        ),
        "qwen2",
        QWEN2_SPLIT,
        needs_tensor="blk.0.ffn_gate_inp_shexp.weight",
        needs_key="moe_intermediate_size",
        hf_misreads_gguf=MOE_GGUF_IN_TRANSFORMERS,
    ),
    # Mixtral: a Llama with experts (llama.cpp's GGUFs call it "llama")
    "mixtral": Family(
        transformers.MixtralForCausalLM,
        transformers.MixtralConfig(**small() | dict(num_local_experts=4, num_experts_per_tok=2)),
        "llama-bpe",
        LLAMA3_SPLIT,
        needs_tensor="blk.1.ffn_gate_inp.weight",
        needs_key="num_local_experts",
        hf_misreads_gguf=MOE_GGUF_IN_TRANSFORMERS,
    ),
    # gpt-oss: sliding (window 8) and full layers in turn, attention sinks, YaRN RoPE (its own settings: x32 of
    # 4096), biases on the attention and the experts, its clamped SwiGLU, the router's top-k then softmax; o200k's
    # tokenizer split
    "gpt-oss": Family(
        transformers.GptOssForCausalLM,
        transformers.GptOssConfig(
            **small(tie_word_embeddings=False, sliding_window=8) | dict(num_local_experts=4, num_experts_per_tok=2)
        ),
        "gpt-4o",
        GPT4O_SPLIT,
        needs_tensor="blk.0.attn_sinks.weight",
        needs_key="num_experts_per_tok",
        hf_misreads_gguf="transformers' GGUF reader fails on gpt-oss's metadata (a TypeError in its reader)",
    ),
}


_BUILT: dict[str, tuple] = {}


def built(name: str, tmp_path_factory) -> tuple[Family, torch.nn.Module, Path, Path]:
    """(family, transformers model, safetensors folder, GGUF file), made once per session."""
    if name not in _BUILT:
        fam = FAMILIES[name]
        folder = tmp_path_factory.mktemp(name) / "hf"
        model = save_tiny_model(fam.model_cls, fam.config, folder)
        byte_level_bpe(
            folder, VOCAB, ["<|im_start|>", "<|im_end|>"], fam.pre_split, fam.tokenizer_class, fam.unused_tokens
        )
        gguf = convert_to_gguf(folder, folder.parent / f"{name}.f32.gguf", pre=fam.pre, sliding_window=fam.gguf_window)
        _BUILT[name] = fam, model, folder, gguf
    return _BUILT[name]


def families(names) -> pytest.fixture:
    """A fixture over the families `names`, each built once."""

    @pytest.fixture(scope="module", params=sorted(names))
    def fixture(request, tmp_path_factory):
        return built(request.param, tmp_path_factory)

    return fixture


family_model = families(FAMILIES)
longrope_model = families(n for n, f in FAMILIES.items() if "long_factor" in (f.config.rope_parameters or {}))
gguf_readable_model = families(n for n, f in FAMILIES.items() if f.hf_misreads_gguf is None)


def ours(path: Path) -> Engine:
    return Engine.from_model(EngineConfig(model=str(path), device="cpu", kv_tokens=1024))


def test_safetensors_logits_and_greedy_match_transformers(family_model):
    fam, model, folder, _ = family_model
    engine = ours(folder)
    try:
        want = hf_logits(model, fam.prompt)[-1]
        got = our_last_logits(engine, fam.prompt)
        assert (got - want).abs().max() <= 1e-4 * (want.max() - want.min())
        assert greedy(engine, fam.prompt, GREEDY_STEPS) == hf_greedy(model, fam.prompt, GREEDY_STEPS)
    finally:
        engine.shutdown()


def test_gguf_from_llama_cpp_converter_gives_transformers_tokens(family_model):
    fam, model, _, gguf = family_model
    engine = ours(gguf)
    try:
        assert greedy(engine, fam.prompt, GREEDY_STEPS) == hf_greedy(model, fam.prompt, GREEDY_STEPS)
    finally:
        engine.shutdown()


def test_transformers_reads_the_same_logits_from_the_converted_gguf(gguf_readable_model):
    """The converter is the oracle for the GGUF path, so check it: transformers' own GGUF reader on its output
    gives the original model's logits (where transformers can read that architecture from GGUF: see
    Family.hf_misreads_gguf)."""
    fam, model, _, gguf = gguf_readable_model
    arch = type(model).__name__
    try:
        back = fam.model_cls.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    except (ValueError, KeyError, NotImplementedError) as e:
        pytest.fail(f"transformers cannot read {arch} from GGUF ({e}); drop this check for the family and say why")
    if fam.gguf_window:  # transformers' GGUF reader leaves the window out, as the converter does: the weights are
        back.config.sliding_window = fam.config.sliding_window  # what this checks
    want = hf_logits(model, fam.prompt)
    assert torch.allclose(hf_logits(back, fam.prompt), want, atol=1e-4 * float(want.max() - want.min()))


def test_longrope_past_the_original_context(longrope_model):
    """Tokens from the original context on take LongRoPE's long factors: each one's logits are those of
    transformers' forward pass decoding token by token over its own KV cache. (transformers' generate() instead drops
    the cache when a sequence first passes the original context and recomputes it all with the long factors; the
    engine keeps the cache, whose earlier keys stay rotated by the short ones.)"""
    _, model, folder, _ = longrope_model
    start = model.config.original_max_position_embeddings
    ids = [(7 * i) % VOCAB for i in range(start + 8)]
    engine = ours(folder)
    try:
        cache = transformers.DynamicCache(config=model.config)
        with torch.inference_mode():
            model(torch.tensor([ids[: start - 4]]), cache=cache, use_cache=True)  # short: all before
            for n in range(start - 4, len(ids)):  # one token at a time across the original context
                want = model(torch.tensor([ids[n : n + 1]]), cache=cache, use_cache=True).logits[0, -1]
                got = our_last_logits(engine, ids[: n + 1])
                assert (got - want).abs().max() <= 1e-4 * (want.max() - want.min()), n
    finally:
        engine.shutdown()


# --- MXFP4: gpt-oss's experts as OpenAI ships them ------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt_oss_mxfp4_model(tmp_path_factory) -> tuple[torch.nn.Module, Path, Path]:
    """(transformers' gpt-oss on its experts' MXFP4 values, the MXFP4 safetensors folder, llama.cpp's GGUF of it)."""
    fam, root = FAMILIES["gpt-oss"], tmp_path_factory.mktemp("gpt-oss-mxfp4")
    model = save_tiny_model(fam.model_cls, fam.config, root / "hf")
    byte_level_bpe(root / "hf", VOCAB, ["<|im_start|>", "<|im_end|>"], fam.pre_split, fam.tokenizer_class)
    gpt_oss_mxfp4(model, root / "hf", root / "mxfp4")
    return model, root / "mxfp4", convert_to_gguf(root / "mxfp4", root / "mxfp4.gguf", pre=fam.pre)


def test_gpt_oss_mxfp4_experts_match_transformers(gpt_oss_mxfp4_model):
    """The MXFP4 safetensors (blocks and E8M0 scales, repacked at load) and llama.cpp's GGUF of them (its MXFP4
    blocks) give transformers' logits and greedy tokens on the same values."""
    model, folder, gguf = gpt_oss_mxfp4_model
    want = hf_logits(model, PROMPT)[-1]
    for path in (folder, gguf):
        engine = ours(path)
        try:
            got = our_last_logits(engine, PROMPT)
            assert (got - want).abs().max() <= 1e-4 * (want.max() - want.min()), path
            assert greedy(engine, PROMPT, GREEDY_STEPS) == hf_greedy(model, PROMPT, GREEDY_STEPS), path
        finally:
            engine.shutdown()


def test_mxfp4_dequantizes_as_llama_cpp(gpt_oss_mxfp4_model):
    """Every MXFP4 tensor llama.cpp's converter wrote, read by llamaterm, equals gguf-py's own dequantization."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from llamaterm.engine.checkpoints.gguf import convert_tensor

    raw = read_gguf_file(gpt_oss_mxfp4_model[2]).tensors
    mxfp4 = [t for t in raw.values() if t.type == GGMLQuantizationType.MXFP4]
    assert {t.name for t in mxfp4} == {f"blk.{i}.ffn_{k}_exps.weight" for i in range(2) for k in ("gate", "up", "down")}
    for t in mxfp4:
        want = torch.from_numpy(dequantize(t.data, t.type).reshape(-1, t.shape[-1]))
        got = convert_tensor(t)
        assert isinstance(got, QuantWeight) and got.codebook == "e2m1"
        assert torch.equal(got.dequantize(), want), t.name


# --- sliding windows beyond the FAMILIES harness ------------------------------------------------------------


def test_ministral_interleaved_sliding_and_full_layers_match_transformers(tmp_path):
    """MinistralForCausalLM's layer_types: a window in one layer, full attention in the other (llama.cpp's
    converter has no Ministral, so safetensors only). A full layer reads every key: no block is ever freed."""
    config = transformers.MinistralConfig(
        **small(sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    )
    model = save_tiny_model(transformers.MinistralForCausalLM, config, tmp_path)
    byte_level_bpe(tmp_path, VOCAB, ["<|im_start|>", "<|im_end|>"])
    engine = ours(tmp_path)
    try:
        assert [engine.core.model.config.layer_window(i) for i in range(2)] == [8, None]
        assert engine.core.block_manager.window is None
        want = hf_logits(model, PROMPT)[-1]
        assert (our_last_logits(engine, PROMPT) - want).abs().max() <= 1e-4 * (want.max() - want.min())
        assert greedy(engine, PROMPT, GREEDY_STEPS) == hf_greedy(model, PROMPT, GREEDY_STEPS)
    finally:
        engine.shutdown()


TEXTS = [
    "Hello world! It's 2024: 12345 apples, 6.78 pears.",
    "  def f(x):\n\treturn x**2  # ok\n\n",
    "Ünïcödé and 我想在 apple 工作 😁 — mixed CASE words, don't STOP",
    "<|im_start|>user\nHi<|im_end|>",
]


def test_gguf_tokenizer_encodes_as_the_tokenizer_json(family_model):
    """The converter's GGUF vocabulary, read as llama.cpp reads it (the family's pre-tokenizer type), gives the
    ids the tokenizers library gives from the folder's tokenizer.json, built with that family's split."""
    _, _, folder, gguf = family_model
    ours_ = Tokenizer.from_gguf_metadata(read_gguf_file(gguf).metadata)
    theirs = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    for text in TEXTS:
        want = theirs.encode(text, add_special_tokens=False).ids
        assert ours_.encode(text, add_special=False, parse_special=True) == want, text


def test_info_names_the_family(family_model):
    """`llamaterm ls` and `info` show the family a checkpoint runs as, whichever format: the converter's GGUF name."""
    _, _, folder, gguf = family_model
    arch = read_gguf_file(gguf).metadata["general.architecture"]
    assert read_checkpoint(folder).family == read_checkpoint(gguf).family == arch


# ---- bad input ----


def test_gguf_whose_metadata_contradicts_its_tensors(family_model, tmp_path):
    fam, _, _, gguf = family_model
    arch = read_gguf_file(gguf).metadata["general.architecture"]
    one_kv_head = {f"{arch}.attention.head_count_kv": (1, GGUFValueType.UINT32)}
    fewer_kv_heads = rewrite_gguf(gguf, tmp_path / "kv.gguf", one_kv_head)
    with pytest.raises(
        ModelFormatError,
        match=r"tensor 'blk\.0\.attn_(k|qkv)\.(weight|bias)' has shape .*; the "
        "metadata implies",
    ):
        load_gguf(fewer_kv_heads)
    lacking = rewrite_gguf(gguf, tmp_path / "lacking.gguf", drop=(fam.needs_tensor,))
    with pytest.raises(ModelFormatError, match=f"tensors are missing: {re.escape(fam.needs_tensor)}"):
        load_gguf(lacking)


def test_config_missing_a_field_the_family_needs(family_model):
    fam, _, folder, _ = family_model
    hf = json.loads((folder / "config.json").read_text())
    *outer, key = fam.needs_key.split(".")
    del (hf[outer[0]] if outer else hf)[key]
    with pytest.raises(ModelFormatError, match=f"config.json: {key} is missing"):
        model_config(hf, "tiny")


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_variants_are_refused_by_name_with_what_runs(tmp_path, name):
    if name[0].isupper():  # a transformers class: config.json
        with pytest.raises(ModelFormatError) as err:
            model_config({"architectures": [name]}, "m")
    else:  # a GGUF's general.architecture
        writer = GGUFWriter(tmp_path / "v.gguf", name)
        writer.add_block_count(2)
        for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.close):
            write()
        with pytest.raises(ModelFormatError) as err:
            load_gguf(tmp_path / "v.gguf")
    message = str(err.value)
    assert f"{REFUSED[name]}, '{name}', is not supported" in message
    assert all(f"{f.models} ({f.arch})" in message for f in SUPPORTED)
    if name == "phimoe":  # and from the command line: `info` says so, `run` fails in one line
        info = llamaterm("info", str(tmp_path / "v.gguf"))
        assert info.returncode == 0 and f"architecture  phimoe: {REFUSED[name]}" in info.stdout
        run = llamaterm("run", "--model", str(tmp_path / "v.gguf"), "hi")
        assert run.returncode == 1 and run.stderr.count("\n") == 1 and "is not supported" in run.stderr


@pytest.mark.cuda
@pytest.mark.parametrize("source", ["safetensors", "gguf"])
def test_gpu_gives_the_cpu_paths_greedy_tokens(family_model, source):
    """The family's tiny model on the GPU (Triton kernels, fp16): every token it picks is the fp32 CPU path's argmax
    wherever that path's top-2 margin is above 0.05, and so the same greedy tokens up to its first near-tie."""
    fam, _, folder, gguf = family_model
    path = folder if source == "safetensors" else gguf
    cpu, gpu = ours(path), Engine.from_model(EngineConfig(model=str(path), device="cuda", kv_tokens=1024))
    try:
        got = greedy(gpu, fam.prompt, GREEDY_STEPS)
        assert_greedy_choices(cpu, fam.prompt, got)
        assert_same_until_near_tie(cpu, fam.prompt, got, greedy(cpu, fam.prompt, GREEDY_STEPS))
    finally:
        cpu.shutdown()
        gpu.shutdown()


@pytest.mark.parametrize("family_model", ["mistral"], indirect=True)
def test_sliding_window_caps_kv_use_of_a_long_generation(family_model):
    """A pool of 64 tokens runs a 19-token prompt through 200 greedy tokens: a sequence holds its window's blocks
    (and one step's), never its whole length, and still gives transformers' tokens."""
    fam, model, folder, _ = family_model
    window, steps, block_size = fam.config.sliding_window, 200, 16
    engine = Engine.from_model(
        EngineConfig(model=str(folder), device="cpu", kv_tokens=64, block_size=block_size, max_batch_tokens=16)
    )
    try:
        assert engine.core.block_manager.num_blocks == 4
        params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
        handle = engine.submit(None, params, prompt_ids=fam.prompt)
        tokens, most = [], 0
        for event in handle.events():
            tokens += event.token_ids
            most = max(most, engine.stats().kv_blocks_used)
        assert tokens == hf_greedy(model, fam.prompt, steps)
        assert most <= -(-(window + 16) // block_size) + 1
    finally:
        engine.shutdown()


# --- on the GPU (the lead runs these on an H200) ------------------------------------------------------------


@pytest.mark.cuda
def test_sliding_window_caps_kv_use_of_a_long_chat_on_the_gpu(tmp_path):
    """Eight turns of a chat, each resending the whole conversation, through a pool of 256 tokens: the chat grows to
    1600 tokens (100 blocks), while the engine holds at most the window's blocks and one step's, prefix-caches the
    window across turns, and picks the fp32 CPU path's tokens."""
    window, block_size, turn_prompt, turn_reply = 64, 16, 40, 160
    config = transformers.MistralConfig(
        **small(sliding_window=window)
        | dict(
            hidden_size=256,
            intermediate_size=512,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=4096,
        )
    )
    save_tiny_model(transformers.MistralForCausalLM, config, tmp_path)
    byte_level_bpe(tmp_path, VOCAB, ["<|im_start|>", "<|im_end|>"])
    cpu = Engine.from_model(EngineConfig(model=str(tmp_path), device="cpu"))
    # steps of at most 64 tokens: a sequence's window and one step fit the small pool (Engine.sequence_limit)
    gpu = Engine.from_model(
        EngineConfig(model=str(tmp_path), device="cuda", kv_tokens=256, block_size=block_size, max_batch_tokens=64)
    )
    try:
        gen, chat, most = torch.Generator().manual_seed(0), [], 0
        params = SamplingParams(max_tokens=turn_reply, temperature=0.0, ignore_eos=True)
        for _ in range(8):
            chat += torch.randint(0, VOCAB, (turn_prompt,), generator=gen).tolist()
            handle = gpu.submit(None, params, prompt_ids=chat)
            reply = []
            for event in handle.events():
                reply += event.token_ids
                most = max(most, gpu.stats().kv_blocks_used)
            assert_greedy_choices(cpu, chat, reply)
            assert handle.stats().cached_tokens >= len(chat) - turn_prompt - block_size  # the window, cached
            chat += reply
        assert len(chat) == 8 * (turn_prompt + turn_reply) > 6 * gpu.pool_tokens()
        # the window, one turn's new tokens and the uncomputed tail of the last reply, a block of alignment
        assert most <= -(-(window + turn_prompt + block_size) // block_size) + 1
    finally:
        cpu.shutdown()
        gpu.shutdown()


# --- Gemma 3 settings as its files write them ---------------------------------------------------------------

GEMMA3_1B = {  # google/gemma-3-1b-it's config.json, in the form the Hub has it (no layer_types, no rope_parameters)
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "num_hidden_layers": 26,
    "vocab_size": 262144,
    "max_position_embeddings": 32768,
    "query_pre_attn_scalar": 256,
    "rope_theta": 1000000,
    "rope_local_base_freq": 10000,
    "rope_scaling": None,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-06,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
}


def test_gemma3_config_json_reads_as_transformers_reads_it():
    """The older config.json form, against transformers' own Gemma3TextConfig on the same keys."""
    ours_, theirs = model_config(GEMMA3_1B, "gemma-3-1b"), transformers.Gemma3TextConfig(**GEMMA3_1B)
    assert [ours_.is_sliding(i) for i in range(26)] == [t == "sliding_attention" for t in theirs.layer_types]
    assert (ours_.sliding_window, ours_.head_dim, ours_.attention_scale) == (512, 256, 256**-0.5)
    assert ours_.rope_theta == theirs.rope_parameters["full_attention"]["rope_theta"]
    assert ours_.rope_theta_sliding == theirs.rope_parameters["sliding_attention"]["rope_theta"]
    assert (ours_.embedding_scale, ours_.tie_word_embeddings) == (1152**0.5, theirs.tie_word_embeddings)


def test_gemma3_gguf_settings_llama_cpp_assumes(tmp_path):
    """Where a Gemma 3 GGUF leaves settings out: every sixth layer global, local base 10000, and the attention
    scale llama.cpp's gemma3 loader picks: head_dim's, or hidden / heads for the 62-layer 27B."""
    for layers, scale in ((26, 256**-0.5), (62, (5376 // 32) ** -0.5)):
        writer = GGUFWriter(tmp_path / f"g{layers}.gguf", "gemma3")
        for add, value in (
            (writer.add_block_count, layers),
            (writer.add_context_length, 32768),
            (writer.add_embedding_length, 5376 if layers == 62 else 1152),
            (writer.add_feed_forward_length, 6912),
            (writer.add_head_count, 32 if layers == 62 else 4),
            (writer.add_key_length, 128 if layers == 62 else 256),
            (writer.add_sliding_window, 1024),
            (writer.add_layer_norm_rms_eps, 1e-6),
            (writer.add_vocab_size, 262144),
        ):
            add(value)
        for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.close):
            write()
        c = gguf_config(read_gguf_file(tmp_path / f"g{layers}.gguf"))
        assert [c.is_sliding(i) for i in range(12)] == [i % 6 != 5 for i in range(12)]
        assert (c.attention_scale, c.rope_theta_sliding, c.sliding_window) == (scale, 10000.0, 1024)
