"""How one forward runs: ragged batching, its attention, the paged KV pool, compiled and graphed steps."""
