"""Access to a directory-like root addressed by a local path or an fsspec URL.

Everything above this module speaks in *relative names* inside a root ("shards/x.tokens"),
never in ``pathlib.Path`` (which would mangle ``s3://``). Publishing is atomic: a local file
is written under a temporary name and renamed; an object-store upload only becomes visible
when the (multipart) PUT completes, and is discarded on error.

Remote requests run under a ``RetryPolicy``: each attempt has a deadline (it is cancelled
when it passes), transient errors are retried with jittered exponential backoff, and
permanent ones (missing credentials, access denied, missing bucket or object) become a
``StorageError`` that names the URL and the fix. How endpoint and credentials are found is
in ``steadytrain.storage.s3``. A whole-file transfer's deadline grows with its size
(``SLOWEST_LINK_BPS``), so a hung PUT ends in ``ReadDeadlineError`` instead of blocking a
checkpoint save forever. Checkpoints (``checkpoint/remote.py``) reach bytes through here too.

A large remote object is downloaded in ranged parts, several at once (``get_file``), the way
s5cmd, boto3's transfer manager and the AWS CRT read one: a single stream is bounded by one
connection's throughput. Each part is its own request with its own deadline and retries; the
object's identity (ETag, else size and modification time) is compared before and after, so
parts of two versions are never published as one file.

A URL carrying credentials (``s3://KEY:SECRET@bucket/x``, a signature in its query) is
refused with a ``StorageError`` that names the URL masked and where credentials go instead
(``redact.url_credentials_message``); secret storage options are registered with
``redact.register_secrets`` so no later message, a client library's included, can show them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import os
import posixpath
import shutil
import threading
from collections.abc import Callable, Iterator
from typing import IO, Any, TypeVar

import fsspec

from steadytrain.errors import SteadyError, StorageError
from steadytrain.extras import missing_extra
from steadytrain.redact import (
    redact_text,
    register_secrets,
    secret_values,
    url_credentials,
    url_credentials_message,
)
from steadytrain.storage.names import backend_module, is_remote_url, safe_relpath
from steadytrain.storage.publish import (
    atomic_writer,
    publish_bytes,
    publish_bytes_if_absent,
    publish_file,
    temp_name,
)
from steadytrain.storage.retry import RetryPolicy, call_with_retry
from steadytrain.storage.s3 import (
    S3_PROTOCOLS,
    endpoint_of,
    is_missing,
    storage_error,
    storage_options_for,
    translate_error,
)

T = TypeVar("T")

__all__ = [
    "Store",
    "safe_relpath",
    "is_remote_url",
    "is_missing",
    "SLOWEST_LINK_BPS",
    "PART_BYTES",
    "PARTS_IN_FLIGHT",
]


# Calls fsspec runs as coroutines on its loop: these accept ``timeout=`` (``open`` does not).
_DEADLINE_METHODS = frozenset(
    {"cat_file", "exists", "size", "info", "ls", "rm", "du", "put_file", "get_file", "pipe_file"}
)

# A whole-file transfer may take its request deadline plus the time its bytes need at this
# rate; anything slower is treated as a hung connection (cancelled, then retried).
SLOWEST_LINK_BPS = 1 << 20

# Ranged downloads: parts of this size, this many in flight (memory bound: their product).
# 16 MiB parts, 8 at once: bench/object_store_download.py reads a 130 MB object in 0.32 s
# this way against 0.59 s in one GET, and 16 parts gained nothing more (medians).
PART_BYTES = 16 << 20
PARTS_IN_FLIGHT = 8


# Storage options that name an identity, not a secret: an access key id is printed in
# access-denied advice and is often a common string (a test's "steadytrain-test").
_IDENTITY_OPTIONS = frozenset({"key", "aws_access_key_id", "username", "user", "account_name"})


def _identity(info: dict[str, Any]) -> tuple[Any, ...]:
    """What says an object is the same version: its ETag where the store gives one, else its
    size and modification time."""
    etag = info.get("ETag") or info.get("etag")
    if etag:
        return (etag,)
    return (info.get("size"), info.get("LastModified") or info.get("mtime"))


def _secrets_to_register(options: dict[str, Any]) -> list[str]:
    """The secret storage options to mask in all later text (``register_secrets``)."""
    identity = {options.get(k) for k in _IDENTITY_OPTIONS} - {None}
    endpoint = (options.get("client_kwargs") or {}).get("endpoint_url") or ""
    secrets = url_credentials(endpoint) if isinstance(endpoint, str) else []
    return secrets + [v for v in secret_values(options) if v not in identity]


class Store:
    """A root (local directory or remote prefix) with atomic writes and relative names.

    ``stats`` counts the remote requests this process made (``requests``, ``bytes_read``,
    ``retries``): the cache benchmark uses it to prove a staged node reads nothing remote.
    ``part_bytes`` and ``parts_in_flight`` shape ``get_file``'s ranged downloads of remote
    objects (an object under two parts is one GET; ``parts_in_flight=1``: always one GET).
    """

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        retry: RetryPolicy | None = None,
        part_bytes: int = PART_BYTES,
        parts_in_flight: int = PARTS_IN_FLIGHT,
    ) -> None:
        if part_bytes < 1 or parts_in_flight < 1:
            raise ValueError(
                f"part_bytes ({part_bytes}) and parts_in_flight ({parts_in_flight}) must be >= 1"
            )
        self.part_bytes = part_bytes
        self.parts_in_flight = parts_in_flight
        refused = url_credentials_message(url)
        if refused:  # s3://KEY:SECRET@bucket would reach botocore as a bucket name
            raise StorageError(refused)
        self.url = url.rstrip("/") or "/"
        self.retry = retry or RetryPolicy.from_env()
        if url.startswith("file://"):
            url = url[len("file://") :]
        self.is_local = not is_remote_url(url)
        self.storage_options = storage_options_for(
            url, storage_options, request_timeout_s=self.retry.request_timeout_s
        )
        # Any message printed from now on (a client library's included) masks these.
        register_secrets(_secrets_to_register(self.storage_options))
        self.stats = {"requests": 0, "bytes_read": 0, "retries": 0}
        self._stats_lock = threading.Lock()
        self._bucket_checked = False
        if self.is_local:
            self.fs = fsspec.filesystem("file")
            self.root = os.path.abspath(os.path.expanduser(url))
        else:
            try:
                self.fs, self.root = fsspec.core.url_to_fs(url, **self.storage_options)
            except ImportError as exc:
                raise missing_extra(backend_module(url), f"opening {url!r}") from exc
            except (ValueError, TypeError) as exc:
                msg = f"cannot open {url!r}: {exc}; check the URL scheme and storage_options"
                raise StorageError(redact_text(msg, secret_values(self.storage_options))) from exc
            self.root = self.root.rstrip("/")
            if hasattr(self.fs, "retries"):
                # s3fs retries a dropped connection 5 times (~2 s) on its own; one attempt
                # per call lets the deadline-aware loop below own (and count) every retry.
                self.fs.retries = 1

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    def path(self, name: str) -> str:
        """The full filesystem path (local) or key (remote) of a relative name."""
        name = safe_relpath(name)
        return (
            posixpath.join(self.root, name) if not self.is_local else os.path.join(self.root, name)
        )

    def display(self, name: str) -> str:
        """A name for error messages: the URL the user gave plus the relative name."""
        return f"{self.url}/{name}" if name else self.url

    def local_path(self, name: str) -> str | None:
        """The local path of ``name`` when the root is local, else None."""
        return self.path(name) if self.is_local else None

    # -- the one place remote calls go through -----------------------------------------
    def _call(
        self, name: str, method: str, *args: Any, deadline_s: float | None = None, **kwargs: Any
    ) -> Any:
        """Call ``self.fs.<method>`` with a per-attempt deadline, retries and clear errors.

        ``deadline_s`` replaces the policy's ``request_timeout_s`` for one long transfer.
        """
        what = self.display(name)
        fn: Callable[..., Any] = getattr(self.fs, method)
        if self.is_local:
            try:
                return fn(*args, **kwargs)
            except FileNotFoundError as exc:
                raise StorageError(f"{what} does not exist") from exc
        if getattr(self.fs, "async_impl", False) and method in _DEADLINE_METHODS:
            # fsspec's sync wrapper cancels the coroutine when the deadline passes.
            kwargs["timeout"] = deadline_s or self.retry.request_timeout_s

        def attempt() -> Any:
            with self._stats_lock:
                self.stats["requests"] += 1
            return fn(*args, **kwargs)

        def on_retry(_attempt: int, _exc: BaseException, _delay: float) -> None:
            with self._stats_lock:
                self.stats["retries"] += 1

        # A store that stops answering is named by its endpoint too: it is what to go check.
        where = f"{what} at {endpoint_of(self.storage_options)}" if self._is_s3 else what
        try:
            return call_with_retry(attempt, what=where, policy=self.retry, on_retry=on_retry)
        except SteadyError:
            raise  # already clear (ReadDeadlineError is also an OSError: keep it as it is)
        except Exception as exc:
            err = storage_error(
                exc, what=what, method=method, url=self.url, storage_options=self.storage_options
            )
            if err is None:
                raise
            raise err from exc

    def _transfer_deadline(self, nbytes: int) -> float:
        """The per-attempt deadline of a whole-file transfer of ``nbytes``."""
        return self.retry.request_timeout_s + nbytes / SLOWEST_LINK_BPS

    @property
    def _is_s3(self) -> bool:
        return not self.is_local and self.url.startswith(S3_PROTOCOLS)

    def _check_bucket(self) -> None:
        """A missing bucket must not read as 'the file is not there yet': say so once."""
        if self._bucket_checked or not self._is_s3:
            return
        bucket = self.root.split("/", 1)[0]
        if not self._call("", "exists", bucket):
            raise StorageError(
                f"{self.url}: bucket {bucket!r} does not exist at "
                f"{(self.storage_options.get('client_kwargs') or {}).get('endpoint_url', 'AWS S3')}"
                f"; create it or fix the URL"
            )
        self._bucket_checked = True

    # -- reading -----------------------------------------------------------------------
    def exists(self, name: str) -> bool:
        if not self.is_local:
            # s3fs answers from its listing cache; another process may have written since.
            self.fs.invalidate_cache(self.path(name))
        found = bool(self._call(name, "exists", self.path(name)))
        if not found:
            self._check_bucket()
        return found

    def size(self, name: str) -> int:
        return int(self._call(name, "size", self.path(name)))

    def read_bytes(self, name: str, start: int | None = None, end: int | None = None) -> bytes:
        """The whole object, or bytes ``[start, end)``; retried as one request."""
        if start is None and end is None:
            data = self._call(name, "cat_file", self.path(name))
        else:
            data = self._call(name, "cat_file", self.path(name), start=start, end=end)
        if not self.is_local:
            with self._stats_lock:
                self.stats["bytes_read"] += len(data)
        return data

    def info(self, name: str) -> dict[str, Any]:
        """fsspec's description of ``name`` (``size``, ``type``, a modification time...)."""
        if not self.is_local:
            self.fs.invalidate_cache(self.path(name))
        return dict(self._call(name, "info", self.path(name)))

    def du(self, name: str) -> int:
        """Total bytes of the files under ``name`` (or of the file ``name``); 0 if missing."""
        if not self.is_local:
            self.fs.invalidate_cache(self.path(name))
        try:
            sizes = self._call(name, "du", self.path(name), total=False)
        except StorageError as exc:
            if is_missing(exc):
                return 0
            raise
        return int(sum(sizes.values()))

    def get_file(self, name: str, local_path: str, *, durable: bool = True) -> None:
        """Download ``name`` to ``local_path`` through ``storage.publish``: a partial download
        never has the final name. ``durable=False``: no fsync (a copy verified, used at once)."""
        if self.is_local:
            try:
                src = open(self.path(name), "rb")  # noqa: SIM115 - closed below
            except FileNotFoundError as exc:
                raise StorageError(f"{self.display(name)} does not exist") from exc
            with src, atomic_writer(local_path, durable=durable) as dst:
                shutil.copyfileobj(src, dst, 8 << 20)
            return
        directory = os.path.dirname(local_path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        tmp = temp_name(local_path)
        try:
            before = self.info(name)  # the size sets the deadlines; the identity is checked
            size = int(before["size"])
            if self.parts_in_flight > 1 and size >= 2 * self.part_bytes:
                self._get_ranged(name, tmp, size, local_path)
                after = self.info(name)
                if _identity(after) != _identity(before):
                    raise StorageError(
                        f"{self.display(name)} changed while it was downloaded in parts "
                        f"({_identity(before)} before, {_identity(after)} after); nothing was "
                        "written: retry once the writer has finished"
                    )
            else:  # each attempt rewrites tmp from byte 0
                _reserve(tmp, size, local_path, self.display(name))
                try:
                    self._call(
                        name,
                        "get_file",
                        self.path(name),
                        tmp,
                        deadline_s=self._transfer_deadline(size),
                    )
                except StorageError as exc:
                    cause = _errno_cause(exc)
                    if cause is None:
                        raise
                    raise _local_write_error(local_path, self.display(name), size, cause) from exc
            publish_file(tmp, local_path, durable=durable)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        with self._stats_lock:
            self.stats["bytes_read"] += size

    def _get_ranged(self, name: str, tmp: str, size: int, local_path: str) -> None:
        """Write ``name``'s ``size`` bytes into ``tmp`` in ranged parts, ``parts_in_flight``
        at a time; the first part that fails (after its retries) cancels the rest."""
        path = self.path(name)
        spans = [(s, min(size, s + self.part_bytes)) for s in range(0, size, self.part_bytes)]
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)

        def local_error(exc: OSError) -> StorageError:
            return _local_write_error(local_path, self.display(name), size, exc)

        def fetch(span: tuple[int, int]) -> None:
            start, end = span
            data = self._call(
                name,
                "cat_file",
                path,
                start=start,
                end=end,
                deadline_s=self._transfer_deadline(end - start),
            )
            if len(data) != end - start:
                raise StorageError(
                    f"{self.display(name)}: bytes [{start}, {end}) came back as {len(data)} "
                    "bytes; the object changed or was cut short while it was downloaded"
                )
            view = memoryview(data)
            try:
                while view:
                    view = view[os.pwrite(fd, view, start + (end - start) - len(view)) :]
            except OSError as exc:
                raise local_error(exc) from exc

        try:
            _fallocate(fd, size, local_error)
            workers = min(self.parts_in_flight, len(spans))
            with concurrent.futures.ThreadPoolExecutor(
                workers, thread_name_prefix="steadytrain-get"
            ) as pool:
                futures = [pool.submit(fetch, span) for span in spans]
                try:
                    for future in concurrent.futures.as_completed(futures):
                        future.result()
                except BaseException:
                    for future in futures:
                        future.cancel()
                    raise
        finally:
            os.close(fd)

    def open_read(self, name: str) -> IO[bytes]:
        """A file object (no per-request deadline: prefer ``read_bytes`` for remote data)."""
        return self._call(name, "open", self.path(name), "rb")

    def listdir(self, name: str = "") -> list[str]:
        """Relative names of the entries directly under ``name`` (empty if it is missing)."""
        base = self.path(name) if name else self.root
        if not self.is_local:
            self.fs.invalidate_cache(base)  # s3fs caches listings; another process may write
        try:
            entries = self._call(name, "ls", base, detail=False)
        except StorageError as exc:
            if is_missing(exc):
                return []
            raise
        prefix = base.rstrip("/") + "/"
        out = []
        for entry in entries:
            entry = str(entry)
            rel = entry[len(prefix) :] if entry.startswith(prefix) else posixpath.basename(entry)
            out.append(posixpath.join(name, rel) if name else rel)
        return sorted(out)

    # -- writing -----------------------------------------------------------------------
    def makedirs(self, name: str = "") -> None:
        if self.is_local:
            os.makedirs(self.path(name) if name else self.root, exist_ok=True)

    def remove(self, name: str, recursive: bool = False) -> None:
        try:
            self._call(name, "rm", self.path(name), recursive=recursive)
        except StorageError as exc:
            if not is_missing(exc):
                raise

    def remove_tree(self, name: str) -> None:
        """Delete ``name`` and everything under it; a tree that is already gone is fine."""
        path = self.path(name)
        if self.is_local:
            try:
                shutil.rmtree(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise StorageError(
                    f"cannot remove {path}: {exc}; check its permissions, or delete it by hand"
                ) from exc
            return
        # Two passes: filer-backed stores (SeaweedFS) keep the emptied "directory" as an
        # object until a second delete; a cached listing would hide what is left.
        for _ in range(2):
            self.fs.invalidate_cache(path)
            try:
                self._call(name, "rm", path, recursive=True)
            except StorageError as exc:
                if is_missing(exc):
                    break
                raise

    def put_file(self, local_path: str, name: str) -> None:
        """Upload ``local_path`` as ``name``, published whole: an object appears only when its
        (multipart) PUT completes, a local copy through ``storage.publish``."""
        final = self.path(name)
        if self.is_local:
            with open(local_path, "rb") as src, atomic_writer(final) as dst:
                shutil.copyfileobj(src, dst, 8 << 20)
            return
        self._check_bucket()
        deadline = self._transfer_deadline(os.path.getsize(local_path))
        self._call(name, "put_file", local_path, final, deadline_s=deadline)
        self.fs.invalidate_cache(final)

    @contextlib.contextmanager
    def open_write_atomic(self, name: str) -> Iterator[IO[bytes]]:
        """Write ``name`` so readers see the old state or the whole new file, never a part."""
        final = self.path(name)
        if self.is_local:
            with atomic_writer(final) as f:
                yield f
            return
        # Object stores: the object appears only when the upload completes; discard on error.
        self._check_bucket()
        f = self._call(name, "open", final, "wb")
        try:
            yield f
        except BaseException:
            with contextlib.suppress(Exception):
                f.discard()
            # Mark closed so the file's __del__ does not flush (and publish) the partial data.
            f.closed = True
            raise
        try:
            f.close()
        except Exception as exc:
            f.closed = True
            err = translate_error(
                exc, what=self.display(name), url=self.url, storage_options=self.storage_options
            )
            if err is None:
                raise StorageError(
                    f"{self.display(name)}: upload failed ({type(exc).__name__}: {exc}); "
                    f"nothing was published, rerun the command"
                ) from exc
            raise err from exc
        self.fs.invalidate_cache(final)

    def write_bytes_atomic(self, name: str, data: bytes) -> None:
        """Publish ``data`` as ``name``: locally through ``storage.publish``; remotely as one
        PUT under the request deadline and retries (a COMMIT or a manifest written last)."""
        if self.is_local:
            publish_bytes(self.path(name), data)
            return
        self._check_bucket()
        self._call(
            name, "pipe_file", self.path(name), data, deadline_s=self._transfer_deadline(len(data))
        )
        self.fs.invalidate_cache(self.path(name))

    def write_bytes_if_absent(self, name: str, data: bytes) -> bool:
        """Create ``name`` holding ``data`` only if nothing has that name: True when this call
        created it, False when it already existed (another writer's claim or lease).

        Locally a finished temporary file is hard-linked onto the name (``link`` fails if
        the name exists, so readers never see a partial file and exactly one of two racing
        writers wins). On S3 it is one PUT with ``If-None-Match: *`` (AWS S3, SeaweedFS); a
        retried PUT whose first answer was lost also reads False, so callers that must know
        write a token into ``data`` and read it back. A store that ignores the condition
        overwrites instead; ``checkpoint/lease.py`` detects and reports that.
        """
        final = self.path(name)
        if self.is_local:
            try:
                return publish_bytes_if_absent(final, data)
            except OSError as exc:
                raise StorageError(
                    f"cannot create {final}: {exc}; the checkpoint root needs a local file "
                    "system with hard links (ext4, xfs, NFS, Lustre)"
                ) from exc
        self._check_bucket()
        try:
            self._call(
                name,
                "pipe_file",
                final,
                data,
                mode="create",
                deadline_s=self._transfer_deadline(len(data)),
            )
        except StorageError as exc:
            cause = exc.__cause__
            response = getattr(getattr(cause, "__cause__", None), "response", None) or {}
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            # s3fs maps a 412 to FileExistsError only when the server names the condition.
            if isinstance(cause, FileExistsError) or status == 412:
                return False
            raise
        finally:
            self.fs.invalidate_cache(final)
        return True


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def _local_write_error(local_path: str, source: str, size: int, exc: OSError) -> StorageError:
    """A download that could not be written locally: the local file and its fix (not the
    store's endpoint or credentials, which were fine)."""
    fix = (
        "free space there (or point the download elsewhere) and retry"
        if exc.errno in _NO_SPACE
        else "check that directory"
    )
    return StorageError(
        f"cannot write {local_path} (downloading {source}, {size} bytes): "
        f"{exc.strerror or exc}; {fix}"
    )


def _fallocate(fd: int, size: int, error: Callable[[OSError], StorageError]) -> None:
    """Reserve ``size`` bytes: a full disk is said before any byte is fetched, where the
    filesystem can tell (elsewhere, the write that finds it full says so)."""
    if size <= 0:
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in _NO_SPACE:
            raise error(exc) from exc


def _reserve(tmp: str, size: int, local_path: str, source: str) -> None:
    """``_fallocate`` for a download written by another hand (fsspec's ``get_file``, which
    rewrites ``tmp`` from byte 0 and so keeps none of the reservation: the check is
    what counts)."""
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        _fallocate(fd, size, lambda exc: _local_write_error(local_path, source, size, exc))
    finally:
        os.close(fd)


def _errno_cause(exc: BaseException) -> OSError | None:
    """The local write error (no space, a read-only file system) behind a failed
    download, else None (a store error)."""
    seen = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (*_NO_SPACE, errno.EROFS):
            return e
        e = e.__cause__ or e.__context__
    return None
