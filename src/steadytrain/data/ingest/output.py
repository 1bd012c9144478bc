"""Where a new dataset is built and how it becomes visible (``tokenize``, Megatron import).

Rules (docs/format.md, part A, "Publication"):

- A local ``DEST`` is built in a hidden temporary sibling (``.NAME.tmp-XXXXXXXX``) and renamed
  into place at the end. Until the rename ``DEST`` does not exist (or is still empty), so a
  crash at any point leaves nothing that ``inspect`` accepts; the sibling is removed on error.
- A remote ``DEST`` (object store: no directory rename) is written in place, shards first and
  ``manifest.json`` last, so it becomes a dataset only when the manifest lands.
- A ``DEST`` that already holds something is never overwritten in place: a dataset there is
  either the same content ("up to date") or an error naming ``DEST`` and the fix; files that
  are not ours are an error; the debris of an unfinished run (``shards/`` and
  ``tokenizer.json`` without a manifest) is cleared.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import Any

from steadytrain.data.read.format import MANIFEST_NAME, Manifest, read_manifest
from steadytrain.errors import DatasetError
from steadytrain.storage.publish import publish_dir, temp_name
from steadytrain.storage.store import Store

__all__ = ["Output", "DEBRIS_NAMES", "result_json"]

# What an unfinished run of ours can leave behind (no manifest yet): safe to clear.
DEBRIS_NAMES = ("shards", "tokenizer.json")


class Output:
    """A destination for one new dataset: check what is there, build, publish or discard."""

    def __init__(self, dest: str) -> None:
        self.dest = dest
        self.store = Store(dest)
        self.existing: Manifest | None = None
        self._debris: list[str] = []
        self._tmp: str | None = None
        self._inspect_dest()

    def _inspect_dest(self) -> None:
        entries = [e for e in self.store.listdir() if not e.startswith(".")]
        if not entries:
            return
        if MANIFEST_NAME in entries:
            try:
                self.existing = read_manifest(self.store)
            except DatasetError as exc:
                raise DatasetError(
                    f"{self.dest} already holds a damaged dataset ({exc}); delete {self.dest} "
                    f"or choose another --out"
                ) from None
            return
        foreign = [e for e in entries if e not in DEBRIS_NAMES]
        if foreign:
            raise DatasetError(
                f"{self.dest} exists and holds files that are not a steadytrain dataset "
                f"(e.g. {foreign[0]!r}); choose a new or empty directory for --out"
            )
        self._debris = entries  # an unfinished earlier run: no manifest, only our files

    def different_dataset_error(self, new_fingerprint: str | None, why: str) -> DatasetError:
        assert self.existing is not None
        new = f" (the new one would be {new_fingerprint})" if new_fingerprint else ""
        return DatasetError(
            f"{self.dest} already holds a different dataset (fingerprint "
            f"{self.existing.fingerprint}{new}: {why}); nothing was changed. Write to another "
            f"--out, or delete {self.dest} first to replace it"
        )

    def begin(self) -> Store:
        """The store to write the new dataset into."""
        if not self.store.is_local:
            for name in self._debris:
                self.store.remove(name, recursive=True)
            return self.store
        root = self.store.root
        os.makedirs(os.path.dirname(root), exist_ok=True)
        self._tmp = temp_name(root)
        os.makedirs(self._tmp)
        return Store(self._tmp)

    @property
    def tmp_path(self) -> str | None:
        return self._tmp

    def commit(self) -> None:
        """Make the built dataset visible at ``DEST`` (local: one rename)."""
        if self._tmp is None:
            return
        root = self.store.root
        for name in self._debris:
            path = os.path.join(root, name)
            if os.path.isdir(path):
                shutil.rmtree(path)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        tmp, self._tmp = self._tmp, None  # from here on the build is published or kept
        try:
            # Onto a missing or (debris cleared) empty DEST: one atomic rename, fsync'd.
            publish_dir(tmp, root)
        except OSError as exc:
            if not os.path.isdir(tmp):
                raise  # renamed, but the directory fsync failed: the OS error says why
            raise DatasetError(
                f"cannot publish the new dataset at {self.dest}: {exc.strerror}; something "
                f"else wrote there meanwhile. The finished dataset is kept at {tmp}"
            ) from None

    def discard(self) -> None:
        """Remove the temporary build (after an error, or when DEST is already up to date)."""
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None


def result_json(url: str, manifest: Manifest, up_to_date: bool, seconds: float) -> dict[str, Any]:
    """The keys every dataset-building command reports first (tokenize, Megatron import)."""
    return {
        "dataset": url,
        "up_to_date": up_to_date,
        **manifest.summary(),
        "seconds": round(seconds, 3),
        "tokens_per_s": round(manifest.num_tokens / seconds, 1) if seconds > 0 else 0.0,
    }
