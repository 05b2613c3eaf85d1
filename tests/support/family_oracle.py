"""Oracles for model families: a tiny random model built with transformers' own class for the architecture,
saved as safetensors beside a small tokenizer; its logits and greedy tokens from transformers (fp32, CPU); and the
same folder converted to GGUF by llama.cpp's own converter (convert_hf_to_gguf.py from the llama.cpp sources in
llama-cpp-python's sdist, fetched by `make test` into .venv/oracle; see the Makefile).

Run as a script, this file is that converter with two changes: a tokenizer built for a test has no entry in the
converter's table of known pre-tokenizer hashes, so the test names the pre-tokenizer (`--pre qwen2`) instead; and
`--sliding-window` has it write config.json's sliding_window as {arch}.attention.sliding_window (with its own
writer), which it leaves out for Mistral (llama.cpp runs Mistral GGUFs with full attention).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

CONVERTER = Path(__file__).resolve().parents[2] / ".venv" / "oracle" / "llama.cpp"

# Text for a small byte-level BPE vocabulary: enough to merge common pieces, any text still encodes (bytes).
CORPUS = [
    "The capital of France is Paris. What is the capital of Italy? Rome!",
    "def main():\n    print('hello, world')  # 12345 67890",
    "Sliding windows, rotary embeddings and a paged KV cache: 我想在 apple 工作 😁",
] * 4


def byte_level_bpe(
    model_dir: Path,
    vocab_size: int,
    specials: list[str],
    pre_split: str | None = None,
    tokenizer_class: str = "PreTrainedTokenizerFast",
    fill: bool = False,
) -> None:
    """A byte-level BPE tokenizer of `vocab_size` tokens (the special ones last) trained on CORPUS, written as
    tokenizer.json + tokenizer_config.json, the way Qwen2 / Llama-3 / Phi-4 ship theirs. `pre_split`: the family's
    pre-tokenizer regex (else GPT-2's). `fill`: <unusedN> tokens fill the vocabulary, as in Gemma's (llama.cpp's
    converter trims Gemma's embedding to the tokenizer's size)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre_split is None)
    tok.pre_tokenizer = (
        byte_level
        if pre_split is None
        else pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pre_split), "isolated"), byte_level])
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(specials), show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    # CORPUS has fewer merges than asked for
    unused = [f"<unused{i}>" for i in range(vocab_size - len(specials) - tok.get_vocab_size())] if fill else []
    tok.add_special_tokens(unused + specials)
    model_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": tokenizer_class,
                "eos_token": specials[-1],
                "bos_token": None,
                "add_bos_token": False,
                "model_max_length": 4096,
            }
        )
    )


def sentencepiece_bpe(model_dir: Path, vocab_size: int) -> None:
    """A SentencePiece BPE tokenizer of `vocab_size` pieces trained on CORPUS with the settings of Gemma's (those
    transformers' GemmaConverter lists: byte fallback, digits split, no dummy prefix, whitespace kept; <pad> <eos>
    <bos> <unk> as ids 0 to 3, the turn markers user-defined), written as tokenizer.model, and as tokenizer.json
    by transformers' own conversion of it, as Gemma's tokenizer.json was made."""
    import io

    import sentencepiece
    from transformers import AutoTokenizer

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        split_digits=True,
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        allow_whitespace_only_pieces=True,
        character_coverage=1.0,
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        pad_piece="<pad>",
        eos_piece="<eos>",
        bos_piece="<bos>",
        unk_piece="<unk>",
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>"],
        minloglevel=2,
    )
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "tokenizer.model").write_bytes(model.getvalue())
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "GemmaTokenizer",
                "bos_token": "<bos>",
                "eos_token": "<eos>",
                "pad_token": "<pad>",
                "unk_token": "<unk>",
                "add_bos_token": True,
                "add_eos_token": False,
            }
        )
    )
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(model_dir)
    # Gemma's own files mark the turn markers special (GemmaConverter.special_tokens): so do these
    markers = ("<start_of_turn>", "<end_of_turn>")
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    for added in spec["added_tokens"]:
        added["special"] = added["special"] or added["content"] in markers
    (model_dir / "tokenizer.json").write_text(json.dumps(spec))
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {str(t["id"]): t for t in spec["added_tokens"]}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))


def save_tiny_model(model_cls, config, model_dir: Path, seed: int = 0) -> torch.nn.Module:
    """transformers' `model_cls(config)` with every parameter random (norm weights too, so a missed norm
    convention shows), saved as safetensors in model_dir. Returns the fp32 model in eval mode."""
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() == 1 else 0.05) + (1.0 if p.dim() == 1 else 0.0))
    model.save_pretrained(model_dir, safe_serialization=True)
    return model


def hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """fp32 next-token logits [len(ids), vocab] for one sequence."""
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def hf_greedy(model: torch.nn.Module, ids: list[int], steps: int) -> list[int]:
    """The argmax after each step, on transformers' own KV cache, end-of-text tokens included (as the engine with
    ignore_eos: generate()'s min_new_tokens would mask them instead)."""
    out, cache, x = [], None, torch.tensor([ids])
    with torch.inference_mode():
        for _ in range(steps):
            r = model(input_ids=x, cache=cache, use_cache=True)
            cache, token = r.cache, int(r.logits[0, -1].argmax())
            out.append(token)
            x = torch.tensor([[token]])
    return out


def convert_to_gguf(
    model_dir: Path,
    out: Path,
    outtype: str = "f32",
    pre: str | None = None,
    sliding_window: bool = False,
    vocab_only: bool = False,
) -> Path:
    """llama.cpp's convert_hf_to_gguf.py on model_dir (in a subprocess: the converter brings its own gguf-py)."""
    if not (CONVERTER / "convert_hf_to_gguf.py").is_file():
        raise FileNotFoundError(f"{CONVERTER} is missing: `make test` fetches llama.cpp's converter (see Makefile)")
    args = [sys.executable, __file__, str(model_dir), "--outfile", str(out), "--outtype", outtype]
    args += (["--pre", pre] if pre else []) + (["--sliding-window"] if sliding_window else [])
    args += ["--vocab-only"] if vocab_only else []
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{done.stderr[-3000:]}")
    return out


def rewrite_gguf(
    src: Path, dst: Path, keys: dict | None = None, drop: tuple[str, ...] = (), tensors: dict | None = None
) -> Path:
    """src written afresh with gguf-py: metadata `keys` set (name -> (value, GGUFValueType); value None: left out),
    the tensors in `drop` left out, and those in `tensors` replaced (name -> (raw blocks uint8 [..., bytes a row],
    its GGMLQuantizationType)). For files that contradict themselves or hold other formats (the converter's output
    is f32 throughout)."""
    import numpy as np
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader, keys = GGUFReader(src), dict(keys or {})
    arch = keys.pop("general.architecture", (reader.fields["general.architecture"].contents(),))[0]
    writer = GGUFWriter(dst, arch)
    for name, f in reader.fields.items():
        if not name.startswith("GGUF.") and name not in ("general.architecture", *keys):
            sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(name, f.contents(), f.types[0], sub)
    for name, (value, vtype) in keys.items():
        if value is not None:  # None: the key left out
            writer.add_key_value(name, value, vtype)
    for t in reader.tensors:
        if t.name in (tensors or {}):
            data, qtype = tensors[t.name]  # type: ignore[index]
            writer.add_tensor(t.name, data, raw_dtype=qtype)
        elif t.name not in drop:
            writer.add_tensor(t.name, np.array(t.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def _run_converter(argv: list[str]) -> None:
    pre = None
    if "--pre" in argv:
        at = argv.index("--pre")
        pre, argv = argv[at + 1], argv[:at] + argv[at + 2 :]
    sliding_window = "--sliding-window" in argv
    argv = [a for a in argv if a != "--sliding-window"]
    sys.path[:0] = [str(CONVERTER), str(CONVERTER / "gguf-py")]
    import convert_hf_to_gguf  # noqa: PLC0415 (the oracle's own module, importable only from CONVERTER)
    from conversion.base import TextModel  # noqa: PLC0415

    if pre is not None:
        TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
    if sliding_window:
        parameters = TextModel.set_gguf_parameters

        def with_window(self):
            parameters(self)
            self.gguf_writer.add_sliding_window(self.hparams["sliding_window"])

        TextModel.set_gguf_parameters = with_window
    sys.argv = ["convert_hf_to_gguf.py", *argv]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    _run_converter(sys.argv[1:])


def save_tiny_qwen3(folder: Path, specials: list[str], context: int) -> Path:
    """A tiny random Qwen3 (transformers' own class) in `folder`, with a byte-level vocabulary of 384 tokens whose
    last are `specials`, and Qwen3's real chat template (tests/data)."""
    import transformers

    from tests.support import DATA

    config = transformers.Qwen3Config(
        vocab_size=384,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=context,
        tie_word_embeddings=True,
    )
    save_tiny_model(transformers.Qwen3ForCausalLM, config, folder)
    byte_level_bpe(folder, 384, specials)
    template = (DATA / "qwen3-0.6b.jinja").read_text(encoding="utf-8")
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config | {"chat_template": template}))
    return folder


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # MXFP4's magnitudes (OCP microscaling spec)


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [..., K] -> (blocks uint8 [..., K / 32, 16], E8M0 scales uint8 [..., K / 32], the values they stand for), as
    gpt-oss's checkpoints store experts: each block of 32 takes the power of two that brings its largest magnitude
    to at most 6, each value the nearest E2M1 code, value 2j in byte j's low nibble and 2j + 1 in its high one."""
    blocks = w.float().reshape(*w.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True).clamp(min=2.0**-100)
    exponent = torch.ceil(torch.log2(amax / 6.0))
    scaled = blocks / torch.exp2(exponent)
    magnitude = (scaled.abs()[..., None] - E2M1).abs().argmin(-1)
    codes = (magnitude | ((scaled < 0) & (magnitude > 0)).to(torch.int64) << 3).to(torch.uint8)
    values = torch.where(codes >= 8, -E2M1[codes.long() & 7], E2M1[codes.long() & 7]) * torch.exp2(exponent)
    packed = codes[..., 0::2] | codes[..., 1::2] << 4
    scales = (exponent[..., 0] + 127).to(torch.uint8)
    return packed, scales, values.reshape(w.shape)


def gpt_oss_mxfp4(model: torch.nn.Module, folder: Path, mxfp4_folder: Path) -> None:
    """gpt-oss's experts in MXFP4, as OpenAI ships them: each expert matrix is replaced in `model` by the values of
    its MXFP4 form (so transformers runs exactly those), the model saved to `folder` in full precision, and to
    `mxfp4_folder` with the experts as *_blocks / *_scales and quantization_config {"quant_method": "mxfp4"}."""
    from safetensors.torch import load_file, save_file

    tensors: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            experts = layer.mlp.experts
            for name in ("gate_up_proj", "down_proj"):
                param = getattr(experts, name)  # [E, in, out]: x @ w
                blocks, scales, values = mxfp4_quantize(param.transpose(1, 2))  # per output row, along the input
                param.copy_(values.transpose(1, 2))
                tensors[f"model.layers.{i}.mlp.experts.{name}_blocks"] = blocks
                tensors[f"model.layers.{i}.mlp.experts.{name}_scales"] = scales
    model.save_pretrained(folder, safe_serialization=True)
    mxfp4_folder.mkdir(parents=True, exist_ok=True)
    full = load_file(folder / "model.safetensors")
    kept = {k: v for k, v in full.items() if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    save_file(kept | tensors, mxfp4_folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (mxfp4_folder / "config.json").write_text(json.dumps(config))
    for f in folder.iterdir():
        if f.name.startswith("tokenizer"):
            (mxfp4_folder / f.name).write_bytes(f.read_bytes())
