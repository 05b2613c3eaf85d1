"""The device the engine runs on, named by the user (--device): checked here, so a typo or a machine without a GPU
is one clear line rather than a torch RuntimeError."""

import os

import torch

from llamaterm.engine.errors import LlamatermError


def resolve_device(name: str | None) -> torch.device:
    """'cpu', 'cuda' or 'cuda:N'; None picks cuda when there is one."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise LlamatermError(f"unknown device {name!r}: use cpu or cuda (cuda:N for the N-th GPU)")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not count:
            raise LlamatermError(f"--device {name}: this machine has no CUDA GPU that torch can use; use --device cpu")
        if device.index is not None and device.index >= count:
            raise LlamatermError(f"--device {name}: this machine has {count} CUDA GPU(s), numbered from 0")
    return device


def check_weights_fit(name: str, weights: tuple[int, int], free: int) -> None:
    """A model whose weights (bytes in all, bytes of them experts: checkpoint_info.weight_bytes) cannot fit the GPU's
    `free` bytes is refused before any of it is read, with the sizes."""
    total, experts = weights
    if total <= free:
        return
    of_them = f", {experts / 2**30:.1f} GiB of them its experts" if experts else ""
    raise LlamatermError(
        f"{name} does not fit the GPU: its weights take {total / 2**30:.1f} GiB{of_them}, and {free / 2**30:.1f} GiB "
        "are free. Pick a smaller quant or model, free the GPU, or run it with --device cpu."
    )


def free_memory(device: torch.device) -> int:
    """Bytes free for the KV cache: the GPU's free memory, or the host memory available without swapping
    (Linux's MemAvailable, which counts the page cache the kernel can drop; free pages elsewhere)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def memory_budget(device: torch.device, gpu_memory: float | None) -> int:
    """Bytes the engine may still take: the free memory; with --gpu-memory (a share of the GPU's total, as vLLM's
    --gpu-memory-utilization), no more than keeps what this process holds within that share."""
    free = free_memory(device)
    if gpu_memory is None:
        return free
    if device.type != "cuda":
        raise LlamatermError("--gpu-memory sets a GPU's share: on the CPU, --kv-tokens sizes the KV cache")
    total, held = torch.cuda.get_device_properties(device).total_memory, torch.cuda.memory_reserved(device)
    if total * gpu_memory <= held:
        raise LlamatermError(
            f"--gpu-memory {gpu_memory:g} is {total * gpu_memory / 1e9:.3g} GB of the GPU's {total / 1e9:.3g} GB, and "
            f"the model's weights take {held / 1e9:.3g} GB of it already: give a larger share"
        )
    return min(free, int(total * gpu_memory) - held)
