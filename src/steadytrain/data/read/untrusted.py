"""Helpers for reading files someone else may have written (manifests, loader states).

Such input is validated field by field and every problem is a ``SteadyError`` naming the
file; these helpers keep the messages short and the reads bounded.
"""

from __future__ import annotations

import os
import stat
from typing import Any

from steadytrain.errors import DatasetError
from steadytrain.storage.store import Store

__all__ = ["short_repr", "check_small_file"]


def short_repr(value: Any, limit: int = 80) -> str:
    """A bounded repr for error messages: one field may hold megabytes, nest 100k deep
    (``repr`` raises RecursionError) or be an int of 4300+ digits (``repr`` raises
    ValueError)."""
    try:
        text = repr(value)
    except (RecursionError, ValueError):
        text = f"<{type(value).__name__} too large to show>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_small_file(store: Store, name: str, max_bytes: int, *, what: str) -> None:
    """Refuse ``name`` unless it is a regular file of at most ``max_bytes`` (remote objects:
    the size only). A FIFO would block the read forever; a device, or a multi-gigabyte
    file, would exhaust memory. Raises ``DatasetError`` naming it."""
    where = store.display(name)
    path = store.local_path(name)
    if path is not None:
        try:
            st = os.stat(path)
        except OSError as exc:
            raise DatasetError(f"{where}: cannot read it ({exc})") from exc
        if not stat.S_ISREG(st.st_mode):
            raise DatasetError(
                f"{where} is not a regular file (a FIFO, device or directory); restore the "
                f"{what} or re-tokenize the dataset"
            )
        size = st.st_size
    else:
        size = store.size(name)
    if size > max_bytes:
        raise DatasetError(
            f"{where} has {size} bytes, more than any {what} ({max_bytes}); it is not a "
            f"steadytrain {what}: restore it or re-tokenize the dataset"
        )
