"""Full screens and modal dialogs of the TUI."""
