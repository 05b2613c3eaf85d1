"""The Textual TUI: several conversations side by side over one engine, each with live tokens/s."""
