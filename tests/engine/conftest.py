"""Fixtures the engine's test modules share."""

from tests.support.tiny_engine import alone, tiny  # noqa: F401  (fixtures: a tiny random Llama and its tokenizer,
# and the replies of requests run alone on it)
