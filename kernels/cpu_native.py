"""The CPU's native kernels (kernels/cpu_native.c): built once with the system C compiler, loaded through ctypes.

The library is compiled at first use with `-O3 -march=native` into the user's cache folder, named by a
hash of the source, the flags and the CPU, so a later run loads it in milliseconds. Where it cannot be had (no C
compiler, a CPU without AVX2/FMA/F16C, a failed build, or LLAMATERM_KERNELS=torch) `library()` returns None, the
callers take the torch references (slower, same results), and one line on stderr says why, once; so it does when
only one core is there to run them.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

import platformdirs

from llamaterm.kernels.dispatch import REFERENCES_ONLY

SOURCE = Path(__file__).with_name("cpu_native.c")
# -fopenmp-simd: only the `omp simd` loop pragmas (sums in vector order), no OpenMP runtime; -fno-math-errno:
# sqrtf and expf without errno bookkeeping
FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-pthread", "-shared", "-fPIC", "-std=gnu11"]
LIBS = ["-lm"]  # after the source, or the linker drops them
NEEDED_CPU_FLAGS = ("avx2", "fma", "f16c")
# The C functions' arguments: p a pointer (a tensor's data_ptr), l a C long, i an int, f a float
ARG_TYPES = {"p": ctypes.c_void_p, "l": ctypes.c_long, "i": ctypes.c_int, "f": ctypes.c_float}
SIGNATURES = {
    "qmatmul": "p l l p p p i i i i l p i",
    "dequantize": "p p p i i i i l l p i",
    "rms_norm": "p p p f l l p p",
    "rope": "p p p p p p l l l l l",
    "silu_and_mul": "p l l p",
    "gelu_tanh_and_mul": "p l l p",
    "swiglu_oai_and_mul": "p l l p",
    "paged_attention": "p p p p l p p l l l l l f l p p",
    "write_kv": "p p p p p l l",
}


chosen_threads: int | None = None  # set by use_threads (--threads)


def use_threads(n: int) -> None:
    """--threads: the kernels' threads, in place of a core each."""
    global chosen_threads
    chosen_threads = n


def threads() -> int:
    return chosen_threads or cores()


@cache
def cores() -> int:
    """The cores this process may run on (a container's or taskset's limit, not the machine's count)."""
    return len(os.sched_getaffinity(0))


def cache_dir() -> Path:
    return platformdirs.user_cache_path("llamaterm") / "native"


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return next((set(line.split(":", 1)[1].split()) for line in text.splitlines() if line.startswith("flags")), set())


@cache
def library() -> ctypes.CDLL | None:
    lib, why = build()
    if lib is None:
        print(f"llamaterm: {why}: using the slower torch kernels on the CPU", file=sys.stderr)
    elif cores() == 1:
        print(
            "llamaterm: this process may use only 1 CPU core: the CPU kernels run on one thread (slower)",
            file=sys.stderr,
        )
    return lib


def build() -> tuple[ctypes.CDLL | None, str]:
    """(the loaded library, "") or (None, why not)."""
    if REFERENCES_ONLY:
        return None, "LLAMATERM_KERNELS=torch"
    missing = [f for f in NEEDED_CPU_FLAGS if f not in cpu_flags()]
    if missing:
        return None, f"this CPU lacks {', '.join(missing)}"
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        return None, f"no C compiler found ({cc})"
    source = SOURCE.read_bytes()
    command = [cc, *FLAGS, str(SOURCE), *LIBS]
    # not the source's path: checkouts of the same source share a build (else each removed the other's and built
    # its own again, a second or so of every command that took turns between them)
    how = " ".join([cc, *FLAGS, *LIBS])
    key = hashlib.sha256(b"\0".join([source, how.encode(), platform_key()]))
    target = cache_dir() / f"cpu_native-{key.hexdigest()[:16]}.so"
    if not target.exists():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # built aside, renamed: never seen half-made
                out = Path(tmp) / target.name
                r = subprocess.run([*command, "-o", str(out)], capture_output=True, text=True)
                if r.returncode:
                    first = (r.stderr.strip().splitlines() or ["no message"])[0]
                    return None, f"building the CPU kernels failed ({first})"
                os.replace(out, target)
            for old in target.parent.glob("cpu_native-*.so"):  # builds of other versions (a process using one
                if old != target:  # keeps its mapping)
                    old.unlink(missing_ok=True)
        except OSError as e:
            return None, f"building the CPU kernels failed ({e})"
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as e:
        return None, f"loading the CPU kernels failed ({e})"
    for name, args in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = [ARG_TYPES[a] for a in args.split()], None
    return lib, ""


def platform_key() -> bytes:
    """-march=native code is only valid on this CPU model: a copied cache folder must not load elsewhere."""
    model = (
        next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")), "")
        if Path("/proc/cpuinfo").exists()
        else ""
    )
    return (model + " ".join(sorted(cpu_flags()))).encode()
