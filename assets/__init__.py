"""Files the app ships: the TUI's styles (read with importlib.resources, so they are found installed or not)."""
