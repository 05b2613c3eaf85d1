"""Helpers for the TUI tests: run a Pilot scenario without an async test plugin, and wait for a condition."""

import asyncio
import time
from collections.abc import Awaitable, Callable

from textual.pilot import Pilot

from llamaterm.app.tui.app import ChatApp


def run(app: ChatApp, scenario: Callable[[Pilot], Awaitable[None]], size: tuple[int, int] = (120, 36)) -> None:
    async def main():
        async with app.run_test(size=size) as pilot:
            await scenario(pilot)

    asyncio.run(main())


async def wait_until(pilot: Pilot, condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Checks every 20 ms. (Not with pilot.pause, which waits for the screen to go quiet: while replies stream,
    that is when they end.)"""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the condition")
        await asyncio.sleep(0.02)


async def engine_ready(pilot: Pilot) -> None:
    """The engine is loaded and the screen has settled (mounted, the prompt focused)."""
    await wait_until(pilot, lambda: pilot.app.chat.engine is not None)
    await pilot.pause()


async def idle(pilot: Pilot) -> None:
    """Every pane's reply has ended and been drawn."""
    await wait_until(pilot, lambda: not any(p.session.busy or p.has_undrawn for p in pilot.app.chat.panes))
    await pilot.pause()
