"""User-facing errors: each names the problem and what to do. The CLI prints them without a traceback."""

import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# What reading code raises on values no check foresaw: a division by a zero dimension, a float past its range, a
# string where a number belongs, JSON nested past Python's recursion limit, a size past memory
MALFORMED = (
    ArithmeticError,
    AttributeError,
    LookupError,
    RecursionError,
    TypeError,
    ValueError,
    MemoryError,
    struct.error,
)


class LlamatermError(Exception):
    """Base class: str(err) is a complete message for the user."""


class ModelNotFound(LlamatermError):
    pass


class ModelFormatError(LlamatermError):
    """A checkpoint that is corrupt, truncated, or uses an architecture / tensor type we do not support."""


@contextmanager
def reading_model(path: Path | str) -> Iterator[None]:
    """Model files are untrusted: where their values get past the checks and fail the reading code, the error is a
    ModelFormatError naming the files, not a traceback (nor, in a store's listing, the end of it)."""
    try:
        yield
    except LlamatermError:
        raise
    except MALFORMED as e:
        raise ModelFormatError(
            f"{path}: the model's files hold values llamaterm cannot read ({type(e).__name__}: {str(e)[:200]}): "
            "download it again, or remove it (llamaterm rm)"
        ) from e


class RequestError(LlamatermError):
    """A request that cannot be served: empty prompt, over the context, invalid sampling values."""
