"""Files of the specdec cache, written whole or not at all."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomically(path: Path, text: str) -> None:
    """Write through a temporary file, so a process reading the cache meanwhile (another worker)
    sees the whole file or none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp_path.write_text(text)
    tmp_path.replace(path)
