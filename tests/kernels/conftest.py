"""Fixtures the kernels' test modules share."""

import pytest
import torch


@pytest.fixture
def poisoned(monkeypatch):
    """torch.empty / empty_like return NaN-filled (float) or 0x7F..-filled (int) memory while a test runs, so an
    element a kernel leaves unwritten fails the test."""
    empty, empty_like = torch.empty, torch.empty_like

    def fill(t):
        return t.fill_(float("nan") if t.is_floating_point() else 0x7F) if t.numel() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(empty_like(*a, **k)))
