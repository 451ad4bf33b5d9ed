"""A job's small files (its report, its job record) written whole or not at all: a kill or a full disk
leaves the file that was there, never half of the new one."""

from __future__ import annotations

import os
from pathlib import Path


def write_text_atomic(path: Path, text: str) -> None:
    """`text` into `path` through a temporary beside it and a rename; the temporary never stays."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
