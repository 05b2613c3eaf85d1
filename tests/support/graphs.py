"""CUDA graphs on the CPU, for the engine's tests: the capture alone stubbed (the work is recorded as a callable
that each replay runs again over the live buffers); the padded buffers and the eager steps over them are real."""

import torch

from llamaterm.engine.serving.cuda_graph import StepGraphs


class Recorded:
    """A CUDA graph's stand-in: each replay runs the recorded work again and writes its output in place."""

    def __init__(self, work, out: torch.Tensor):
        self.work, self.out, self.replays = work, out, 0

    @torch.inference_mode()  # (the output is made in inference mode, as the work runs)
    def replay(self) -> None:
        self.out.copy_(self.work())
        self.replays += 1


def record_without_running(self: StepGraphs, work):
    """As a capture, nothing takes effect: the work runs once over padding alone (no KV written, nothing sampled),
    for its output's shape."""
    live = self.flat.clone(), self.tables.clone()
    self.flat.copy_(self._padding[0])
    self.tables.copy_(self._padding[1])
    out = work()
    self.flat.copy_(live[0])
    self.tables.copy_(live[1])
    return Recorded(work, out), out
