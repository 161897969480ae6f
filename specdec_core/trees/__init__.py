"""Candidate trees: their layout, named topologies, tree verification, EAGLE-2's dynamic trees, EntMTP's scheduler."""
