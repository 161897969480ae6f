"""The target's side of a step: the scorer that verifies drafts, its kept states, its rows compacted for the wire."""
