"""Weights and their layout: loading checkpoints, FP8, tensor and pipeline parallelism, CPU kernels."""
