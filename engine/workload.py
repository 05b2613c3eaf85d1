"""What a benchmark's sessions send, as users send it: chat messages of realistic lengths, sampled with every filter
on, token counts forced. Shared by the engine benchmarks (engine/bench.py) and the server's load (app/serve_load.py);
no torch here, so a load generator stays light."""

import random
from dataclasses import dataclass

# llama.cpp's and ollama's sampling defaults, with the repetition penalty users reach for
FILTERS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.1}
GREEDY = {"temperature": 0.0}

# Prompt lengths of chat traffic: mostly short turns, some pasted documents, a few long ones.
CHAT_PROMPTS = ((0.70, 16, 255), (0.25, 256, 1023), (0.05, 1024, 2000))
CHAT_OUTPUTS = (32, 512)

# Common English words, each one token (with its leading space) in the usual BPE vocabularies, so a prompt of N
# words is roughly N tokens: close enough for a load test.
WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by word "
    "but not what all were we when your can said there use an each which she do how their if will up other about "
    "out many then them these so some her would make like him into time has look two more write go see number no "
    "way could people my than first water been call who oil its now find long down day did get come made may part "
    "over new sound take only little work know place year live me back give most very after thing our just name "
    "good sentence man think say great where help through much before line right too mean old any same tell boy "
    "follow came want show also around form three small set put end does another well large must big even such"
).split()


@dataclass(frozen=True)
class PromptMix:
    """Per request: a prompt length (tokens for token-id prompts; words for chat messages, about a token each)
    and a max_tokens, drawn from ranges with weights."""

    prompts: tuple[tuple[float, int, int], ...]  # (weight, shortest, longest)
    outputs: tuple[int, int]

    @classmethod
    def fixed(cls, prompt: int, outputs: tuple[int, int]) -> "PromptMix":
        return cls(((1.0, prompt, prompt),), outputs)

    @classmethod
    def chat(cls) -> "PromptMix":
        return cls(CHAT_PROMPTS, CHAT_OUTPUTS)

    def draw(self, rng: random.Random) -> tuple[int, int]:
        _, lo, hi = rng.choices(self.prompts, weights=[w for w, _, _ in self.prompts])[0]
        return rng.randint(lo, hi), rng.randint(*self.outputs)

    @property
    def longest(self) -> int:
        return max(hi for _, _, hi in self.prompts)


def chat_message(rng: random.Random, words: int) -> list[dict]:
    """A user turn of random common words: no two share a prefix beyond the chat template's."""
    return [{"role": "user", "content": " ".join(rng.choices(WORDS, k=words))}]
