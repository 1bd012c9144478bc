"""The embedded demo corpus: the Python standard library's own source files.

Every machine with Python has it, it is real text (~30 MB of code and docstrings), and it
holds a few non-UTF-8 test files, which exercise the decode-and-report path for free.
"""

from __future__ import annotations

import os
import sysconfig

__all__ = ["stdlib_dir", "stdlib_corpus_paths"]

# Third-party packages installed under the stdlib directory are not part of the corpus.
_EXCLUDE_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_corpus_paths(limit_bytes: int | None = None) -> list[str]:
    """Every ``*.py`` file of the standard library, sorted by relative path (deterministic).

    ``limit_bytes`` keeps the first files (in that order) up to about that many bytes, for
    quick demos and tests.
    """
    root = stdlib_dir()
    found: list[tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(root):  # does not follow directory links
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDE_DIRS and not d.startswith(".")]
        for fn in filenames:
            if fn.endswith(".py"):
                path = os.path.join(dirpath, fn)
                found.append((os.path.relpath(path, root).replace(os.sep, "/"), path))
    found.sort()
    paths, total = [], 0
    for _, path in found:
        if limit_bytes is not None and total >= limit_bytes:
            break
        paths.append(path)
        total += os.path.getsize(path)
    return paths
