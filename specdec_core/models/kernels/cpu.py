"""Process-wide CPU settings for decoding."""

from __future__ import annotations

import ctypes
import ctypes.util

import torch


def configure_cpu(num_threads: int) -> None:
    """torch's thread count, and glibc's malloc kept from returning each multi-MB temporary to
    the OS. Its default serves allocations above a (dynamic) threshold with fresh mmap pages, so
    every [K, V] temporary of a verify paid hundreds of page faults (a 15 x 49152 entropy took
    4x as long). No-op for malloc without glibc."""
    torch.set_num_threads(num_threads)
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if hasattr(libc, "mallopt"):
        m_trim_threshold, m_mmap_threshold = -1, -3
        libc.mallopt(m_mmap_threshold, 32 << 20)  # glibc's maximum
        libc.mallopt(m_trim_threshold, 256 << 20)
