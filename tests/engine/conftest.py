"""Fixtures the engine's test modules share."""

from tests.support.tiny_engine import tiny  # noqa: F401  (a fixture: a tiny random Llama and its tokenizer)
