"""The Textual TUI: several conversations side by side, each pane on a local or remote engine, with live tokens/s.
May import the rest of llamaterm.app and llamaterm.engine, but never torch: local engines run in child processes."""
