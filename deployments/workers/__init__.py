"""The draft and target workers: their services, sessions, continuous batching, admission, tensor parallelism."""
