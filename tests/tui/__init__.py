"""The Textual app: pilot tests per feature, the panes' backends, the render budget, snapshots, transcripts, end to
end."""
