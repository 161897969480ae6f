"""Counting the operations a decision launches over vocabulary-wide rows."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class VocabularyOps(TorchDispatchMode):
    """Counts the operations whose output holds vocabulary-wide rows (last dim `vocab_size`)."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size, self.count = vocab_size, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        self.count += any(isinstance(each, torch.Tensor) and each.shape[-1:] == (self.vocab_size,) for each in outputs)
        return output
