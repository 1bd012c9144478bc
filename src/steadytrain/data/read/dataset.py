"""``TokenDataset``: a read-only view of a token-shard dataset, local or remote.

Shards are memory-mapped on first use and never loaded whole. A remote dataset
(``s3://…``) is read through a node-local ``ShardCache`` that fetches, verifies and
publishes each shard before it is mapped. The object pickles to a few strings (URL, cache
directory, manifest), so loader worker processes re-open their own maps.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from typing import Any

import numpy as np

from steadytrain.data.read.format import Manifest, read_manifest
from steadytrain.errors import DatasetError
from steadytrain.storage.store import Store

__all__ = ["TokenDataset", "open_shard_cache", "local_file_problem"]

# Signature of the hook that turns a shard file name into a local path (the cache).
Resolver = Callable[[str, int, str], str]


def open_shard_cache(cache_dir: str, store: Store, manifest: Manifest, **kwargs: Any) -> Any:
    """The node-local ``ShardCache`` of a dataset: one unit per shard (token file + index
    file, fetched and evicted together), namespaced by the dataset fingerprint so two
    datasets (or a re-tokenized one) never share cache entries."""
    from steadytrain.storage.cache import FileSpec, ShardCache

    units = [
        [
            FileSpec(s.name, s.bytes, s.checksum),
            FileSpec(s.index_name, s.index_bytes, s.index_checksum),
        ]
        for s in manifest.shards
    ]
    return ShardCache(cache_dir, store, units, manifest.fingerprint, **kwargs)


def local_file_problem(root: str, path: str) -> str | None:
    """What is wrong with a dataset file at a local ``path`` under ``root`` before it is
    opened, or None: it must be a regular file whose resolved path stays inside the root.
    A FIFO would block the first read forever; a device, or a link to a file elsewhere,
    would be read as tokens (``open`` and ``verify`` both refuse them)."""
    real_root, real = os.path.realpath(root), os.path.realpath(path)
    if os.path.commonpath([real_root, real]) != real_root:
        return (
            f"leads outside the dataset directory {root} (a symbolic link to {real}); a "
            f"dataset's files must live inside it"
        )
    try:
        st = os.stat(real)
    except FileNotFoundError:
        return "is missing (listed in the manifest)"
    except OSError as exc:
        return f"cannot be read ({exc})"
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file (a FIFO, device or directory)"
    return None


class TokenDataset:
    """A token-shard dataset opened for reading.

    ``TokenDataset.open("s3://bucket/ds", cache_dir="/nvme/cache")`` or a local path.
    """

    def __init__(
        self,
        url: str,
        manifest: Manifest,
        *,
        cache_dir: str | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self.url = url
        self.manifest = manifest
        self.cache_dir = cache_dir
        self.storage_options = storage_options
        self.store = Store(url, storage_options)
        self._maps: dict[int, np.ndarray] = {}
        self._doc_ends: dict[int, np.ndarray] = {}
        self._resolver: Resolver | None = None
        if not self.store.is_local:
            self._resolver = self._make_cache_resolver()

    # -- construction ------------------------------------------------------------------
    @classmethod
    def open(
        cls,
        url: str,
        *,
        cache_dir: str | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> TokenDataset:
        store = Store(url, storage_options)
        manifest = read_manifest(store)
        ds = cls(url, manifest, cache_dir=cache_dir, storage_options=storage_options)
        if store.is_local:
            ds._check_local_files()
        return ds

    def _check_local_files(self) -> None:
        """Cheap structural check at open (metadata only); ``verify`` checks every byte.

        Each listed file must be a regular file inside the dataset directory (after
        resolving links) with exactly its listed size: a FIFO would block the first read, a
        device or a link to a file elsewhere would be read as tokens, and a short file would
        fail inside numpy's mmap naming nothing.
        """
        root = self.store.root
        fix = (
            f"restore it or re-tokenize the dataset (`steadytrain verify {self.url}` lists "
            f"every problem)"
        )
        for shard in self.manifest.shards:
            for name, expected in (
                (shard.name, shard.bytes),
                (shard.index_name, shard.index_bytes),
            ):
                path = self.store.local_path(name)
                assert path is not None
                problem = local_file_problem(root, path)
                if problem is None:
                    try:
                        size = os.stat(path).st_size
                    except OSError as exc:  # removed since the check
                        problem = f"cannot be read ({exc})"
                if problem is not None:
                    raise DatasetError(f"{path} {problem}; {fix}")
                if size != expected:
                    raise DatasetError(
                        f"{path} has {size} bytes, the manifest says {expected}: the file "
                        f"is truncated or was replaced; {fix}"
                    )

    def _make_cache_resolver(self) -> Resolver:
        if self.cache_dir is None:
            raise DatasetError(
                f"{self.url} is remote: pass cache_dir= (a node-local directory, e.g. on NVMe) "
                f"so shards are fetched once, verified and memory-mapped"
            )
        cache = open_shard_cache(self.cache_dir, self.store, self.manifest)
        self.cache = cache
        return cache.local_path

    def __getstate__(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "manifest": self.manifest,
            "cache_dir": self.cache_dir,
            "storage_options": self.storage_options,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(  # type: ignore[misc]
            state["url"],
            state["manifest"],
            cache_dir=state["cache_dir"],
            storage_options=state["storage_options"],
        )

    # -- properties --------------------------------------------------------------------
    @property
    def fingerprint(self) -> str:
        return self.manifest.fingerprint

    @property
    def num_shards(self) -> int:
        return len(self.manifest.shards)

    @property
    def num_tokens(self) -> int:
        return self.manifest.num_tokens

    @property
    def num_docs(self) -> int:
        return self.manifest.num_docs

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.manifest.dtype).newbyteorder("<")

    @property
    def vocab_size(self) -> int:
        return self.manifest.vocab_size

    @property
    def eos_id(self) -> int:
        return self.manifest.eos_id

    def shard_token_counts(self) -> np.ndarray:
        return np.array([s.tokens for s in self.manifest.shards], dtype=np.int64)

    # -- data access -------------------------------------------------------------------
    def local_path(self, name: str, size: int, checksum: str) -> str:
        """Local path of a dataset file: the file itself, or its verified cache copy."""
        if self._resolver is not None:
            return self._resolver(name, size, checksum)
        path = self.store.local_path(name)
        assert path is not None
        return path

    def tokens(self, shard: int) -> np.ndarray:
        """The shard's token ids as a read-only memory map (nothing is read until used)."""
        arr = self._maps.get(shard)
        if arr is None:
            info = self.manifest.shards[shard]
            path = self.local_path(info.name, info.bytes, info.checksum)
            arr = self._map(path, self.dtype, info.tokens)
            self._maps[shard] = arr
        return arr

    def doc_ends(self, shard: int) -> np.ndarray:
        """Exclusive end offset (in tokens) of every document of the shard, ascending."""
        arr = self._doc_ends.get(shard)
        if arr is None:
            info = self.manifest.shards[shard]
            path = self.local_path(info.index_name, info.index_bytes, info.index_checksum)
            arr = self._map(path, np.dtype("<u8"), info.docs)
            self._doc_ends[shard] = arr
        return arr

    def _map(self, path: str, dtype: np.dtype, count: int) -> np.ndarray:
        """A read-only map of ``count`` items; a file changed since open (shorter, gone)
        gives an error naming it, not numpy's."""
        if count == 0:
            return np.empty(0, dtype=dtype)  # mmap cannot map zero bytes
        try:
            return np.memmap(path, dtype=dtype, mode="r", shape=(count,))
        except (OSError, ValueError) as exc:
            raise DatasetError(
                f"{path} cannot be mapped as {count} {dtype} values ({exc}); it changed since "
                f"the dataset was opened: run `steadytrain verify {self.url}`"
            ) from exc

    def close(self) -> None:
        self._maps.clear()
        self._doc_ends.clear()

    def __repr__(self) -> str:
        return (
            f"TokenDataset({self.url!r}, shards={self.num_shards}, tokens={self.num_tokens}, "
            f"fingerprint={self.fingerprint[:12]})"
        )
