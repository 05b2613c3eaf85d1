"""How a GGUF checkpoint's files are named: one .gguf file, or the parts of a split one, numbered from 1
(llama.cpp's gguf-split). The store, the Hub client and the GGUF reader all ask here; nothing here reads a file."""

import re

# Native GGUF shards: `<prefix>-00001-of-00003.gguf`.
SPLIT_GGUF = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def is_first_gguf(path: str) -> bool:
    """A single .gguf file, or the first part of a split one."""
    m = SPLIT_GGUF.match(path)
    return path.endswith(".gguf") and (m is None or m["no"] == "00001")
