"""The app room's fixtures."""

from collections.abc import Iterator

import pytest

from llamaterm.app.announcements import servers_dir


@pytest.fixture
def no_announcements() -> Iterator[None]:
    """No server announced on this machine (the tests' runtime folder) as the test starts, nor as it ends."""
    folder = servers_dir()
    for file in folder.glob("*") if folder.exists() else []:
        file.unlink()
    yield
    for file in folder.glob("*") if folder.exists() else []:
        file.unlink()
