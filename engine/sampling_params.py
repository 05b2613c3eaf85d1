"""Per-request sampling settings, validated up front so a bad value fails its request, not the engine loop."""

import math
from dataclasses import dataclass

from llamaterm.engine.errors import RequestError

# As OpenAI's API bounds them. A reply's text is held back while a stop string could begin in it: a long stop
# string would hold back the whole reply, streaming it in one piece at the end
MAX_STOPS, MAX_STOP_CHARS = 4, 256
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's top_logprobs)
MAX_BIAS = 100.0  # |logit_bias| (OpenAI's range); a token id is checked against the vocabulary at submit
GRAMMAR_KINDS = ("json", "json_schema", "regex", "lark")
# The sampler's tables hold the numbers as float32 and int64 (engine/serving/sampling.py): a value past them would
# fail the step it is written in, and every request in that step
FLOAT32_MAX, INT64_END = 3.4028234663852886e38, 2**63
MIN_REPETITION_PENALTY = 1e-30  # a seen token's logit divided by less overflows float32 (and its row samples nothing)


@dataclass(frozen=True)
class Grammar:
    """What a reply's text must match, enforced token by token as it is sampled (engine/serving/grammar.py):
    "json" any JSON object; "json_schema" text is a JSON Schema (as JSON); "regex" a regular expression over the
    whole reply; "lark" a grammar in llguidance's Lark syntax (which can embed JSON schemas)."""

    kind: str
    text: str = ""

    def __post_init__(self):
        if self.kind not in GRAMMAR_KINDS:
            raise RequestError(f"invalid grammar kind {self.kind!r}: one of {', '.join(GRAMMAR_KINDS)}")


class SamplingError(RequestError):
    """An invalid sampling value; `field` names it (a server's 400 names the request's field)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"invalid sampling value: {message}")
        self.field = field


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 512
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off (divides positive logits of seen tokens, multiplies negative)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; n >= 0: each token's log-probability and its n likeliest alternatives
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit before any filter)
    grammar: Grammar | None = None
    # fields the user did not set and no default filled: a remote engine leaves them out of its request, for the
    # server's own defaults (engine/checkpoints/sampling_defaults.py)
    unset: frozenset[str] = frozenset()

    def __post_init__(self):
        checks = [
            ("max_tokens", self.max_tokens >= 1, "max_tokens must be >= 1"),
            ("temperature", 0 <= self.temperature <= FLOAT32_MAX, "temperature must be >= 0 and finite"),
            ("top_k", 0 <= self.top_k < INT64_END, "top_k must be in [0, 2**63) (0 turns it off)"),
            ("top_p", 0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            ("min_p", 0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (
                "repetition_penalty",
                MIN_REPETITION_PENALTY <= self.repetition_penalty <= FLOAT32_MAX,
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, {FLOAT32_MAX:.3g}] (1 turns it off)",
            ),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            ("stop", all(s for s in self.stop), "stop strings must not be empty"),
            (
                "stop",
                len(self.stop) <= MAX_STOPS and all(len(s) <= MAX_STOP_CHARS for s in self.stop),
                f"stop takes at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters each",
            ),
            ("seed", self.seed is None or 0 <= self.seed < 2**64, "seed must be in [0, 2**64)"),  # kernels/sampling.py
            (
                "logprobs",
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                f"logprobs must be in [0, {MAX_LOGPROBS}]",
            ),
            (
                "logit_bias",
                all(t >= 0 and math.isfinite(b) and abs(b) <= MAX_BIAS for t, b in self.logit_bias),
                f"logit_bias takes token ids >= 0 and biases in [-{MAX_BIAS:g}, {MAX_BIAS:g}]",
            ),
        ]
        for field, ok, message in checks:
            if not ok:
                raise SamplingError(field, message)

    def check_vocabulary(self, vocab_size: int) -> None:
        """What the fields can only be checked against: the model's vocabulary."""
        if any(token >= vocab_size for token, _ in self.logit_bias):
            raise RequestError(f"logit_bias names a token id outside the vocabulary (0..{vocab_size - 1})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
