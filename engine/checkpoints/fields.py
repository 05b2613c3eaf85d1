"""Typed reads of untrusted key-value metadata: GGUF metadata and Hugging Face config.json.

A value of the wrong type is a ModelFormatError that names the key and what it should hold, never a TypeError
deep inside a loader. GGUF numeric arrays arrive as numpy arrays (views of the mapped file), string arrays as
lists of str.
"""

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from llamaterm.engine.errors import ModelFormatError

MISSING = object()  # the default of a key that must be there


def _is_int(v) -> bool:
    return isinstance(v, int | np.integer) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return _is_int(v) or isinstance(v, float | np.floating)


def _is_array(v, dtype_kinds: str, item) -> bool:
    if isinstance(v, np.ndarray):
        return v.ndim == 1 and v.dtype.kind in dtype_kinds
    return isinstance(v, list) and all(item(x) for x in v)


# kind -> (what the user is told it should be, the check)
KINDS = {
    int: ("an integer", _is_int),
    float: ("a number", _is_number),
    bool: ("true or false", lambda v: isinstance(v, bool | np.bool_)),
    str: ("a string", lambda v: isinstance(v, str)),
    dict: ("an object", lambda v: isinstance(v, dict)),
    "strings": ("an array of strings", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)),
    "ints": ("an array of integers", lambda v: _is_array(v, "iu", _is_int)),
    "bools": ("an array of true/false values", lambda v: _is_array(v, "b", lambda x: isinstance(x, bool))),
    "numbers": ("an array of numbers", lambda v: _is_array(v, "iuf", _is_number)),
}


def read(data: Mapping, key: str, kind, default=MISSING, *, where: str, positive: bool = False):
    """data[key] checked to be of `kind` (a key of KINDS); `default` when the key is absent (or null).

    positive: a number must also be > 0 and finite (sizes, counts, epsilons)."""
    value = data.get(key)
    if value is None:
        if default is MISSING:
            raise ModelFormatError(f"{where}: {key} is missing; the model cannot be loaded without it")
        return default
    expected, check = KINDS[kind]
    if check(value) and not (positive and not 0 < value < math.inf):
        return value
    if positive:
        expected = f"a positive {'integer' if kind is int else 'number'}"
    raise ModelFormatError(
        f"{where}: {key} = {_shown(value)} is not {expected}; the file is damaged or was "
        "made by a broken converter: re-download the model"
    )


def reader(where: str, absent: object = None) -> Callable[..., Any]:
    """read() for the key-values of one file, named `where` in its errors: get(data, key, kind[, default],
    positive=False). A key a call gives no default for is optional (absent: None) or, with absent=MISSING, required."""

    def get(data: Mapping, key: str, kind, default: object = absent, *, positive: bool = False):
        return read(data, key, kind, default, where=where, positive=positive)

    return get


def _shown(value) -> str:
    if isinstance(value, np.ndarray | list):
        kinds = sorted({type(x).__name__ for x in value[:100]}) if isinstance(value, list) else [str(value.dtype)]
        return f"an array of {len(value)} ({', '.join(kinds) or 'empty'})"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
