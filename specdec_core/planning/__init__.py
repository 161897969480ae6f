"""Memory planning: what a target needs on GPUs, and what a worker rank's KV pool gets."""
