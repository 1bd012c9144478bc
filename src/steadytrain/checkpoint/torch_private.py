"""Every private PyTorch API steadytrain relies on, in one place, checked before first use.

Private names carry no compatibility promise: a torch release may rename, reshape or drop
them without a deprecation cycle. Each one used under ``src/`` is fenced here, with why we use
it, so that callers (``archive``, ``reader``, ``writer``) import them from this module only:

- ``torch._weights_only_unpickler.Unpickler`` with its ``persistent_load`` hook (the
  unpickler behind ``torch.load(weights_only=True)``): parses a ``torch.save`` pickle onto
  the ``meta`` device, ~10x cheaper per tensor than ``torch.load`` (``archive.py``).
- ``torch.storage.TypedStorage(..., _internal=True)``: what ``persistent_load`` must return,
  built the way ``torch.load`` builds it (without ``_internal`` every call warns that
  ``TypedStorage`` is deprecated).
- ``FileSystemReader.storage_data``: DCP's ``{storage index: _StorageInfo(relative_path,
  offset, length, transform_descriptors)}``, where each item sits in which ``.distcp`` file
  (``reader.py`` reads tensor bytes straight from there).
- ``AsyncStager._synchronize_after_execute``: the attribute behind the stager protocol's
  ``should_synchronize_after_execute``; ``IdentityStager`` sets both so ``dcp.async_save``
  neither copies nor waits for a state dict we already staged (``writer.py``).
- ``torch.distributed.checkpoint._async_process_executor._CHECKPOINT_PROCESS`` (and its
  ``_save_process``): the one checkpoint daemon of ``async_save(PROCESS)``. DCP caches it for
  the life of the process and never notices its death, so every later save fails with
  ``BrokenPipeError``; ``writer.py`` reads whether it is alive and forgets a dead one so the
  next save starts a new daemon.
- ``_StorageInfo(...)`` built, and ``_StoragePrefix.prefix`` read, by a writer: a DCP
  ``StorageWriter`` returns one ``_StorageInfo`` per item it wrote (``WriteResult``'s
  ``storage_data``), which is what ``.metadata`` records and every ``FileSystemReader``
  looks up; the plan's ``_StoragePrefix`` names this rank's files (``__R_``). The raw-record
  writer (``raw_records.py``) writes its own records and must speak both.
- ``FileSystemWriter.fs``: the ``FileSystem`` a DCP writer creates and renames its files
  through (torch's own ``FsspecWriter`` swaps it the same way). ``hashing_writer.py`` puts
  one there that hashes each file as DCP writes it, so COMMIT's checksums need no re-read.
- ``torch.utils.serialization.config``'s ``save.compute_crc32`` held per thread (a
  ``ContextVar``, since torch 2.x's config modules keep user overrides per thread): the public
  ``torch.serialization.set_crc32_options`` then changes only the calling thread's
  ``torch.save``. ``hashing_writer.py`` turns the zip CRC-32 off in the one thread that runs
  DCP's write, and only while it runs; on a torch where the setting is process-wide it keeps
  the CRC (``zip_crc_off_in_this_thread``), so no other thread's archive ever loses it.
- DDP's bucket layout, for ``steadytrain.exact_ddp`` (``ddp.py``): the function DDP's own
  rebuild groups gradients with (``torch.distributed._compute_bucket_assignment_by_size``),
  its default first-bucket cap, and three attributes of a ``DistributedDataParallel``
  (``_has_rebuilt_buckets``, ``_bucket_config``, ``_comm_hooks``). ``exact_ddp`` catches
  ``TorchAPIError`` and leaves DDP as it is with a warning: a missing API there costs the
  last bits of a resumed run on 3 or more ranks, never the job.
- ``Reducer._remove_autograd_hooks`` (``ddp_remove_hooks``): in-place recovery
  (``inplace/recovery.py``) drops a DDP whose process group died and builds a new one over
  the same module; the old reducer's hooks on the parameters would otherwise outlive it
  (anything still referencing it, a traceback's frame, keeps it alive) and all-reduce on
  the dead group at the next backward. Where this torch lacks it, nothing is removed and
  the garbage collector's release of the old reducer is what removes them.
- ``torch.distributed.distributed_c10d._abort_process_group`` (``abort_process_groups``):
  an NCCL group blocked on a dead peer is aborted, not destroyed, before a regroup
  (``inplace/regroup.py``); None where this torch lacks it (then the in-place path falls
  back to the whole restart). Not run here: no GPU.

Each API is checked once, at first use, not at import: ``import steadytrain`` (and
``tokenize``, ``verify``, the loader) must keep working on any torch. A missing or reshaped
API raises ``TorchAPIError`` (a ``CheckpointError``) that names the torch version, the API and
the fix, instead of an ``AttributeError`` deep inside a restore. tests/unit/test_torch_private.py
exercises each API, so a torch upgrade that changes one fails loudly there first.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib
import inspect
import io
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch

from steadytrain.errors import CheckpointError

__all__ = [
    "TorchAPIError",
    "StorageInfo",
    "IdentityStager",
    "unpickle_weights_only",
    "typed_storage",
    "storage_infos",
    "identity_stager",
    "checkpoint_daemon",
    "forget_checkpoint_daemon",
    "file_system_writer",
    "storage_info",
    "file_prefix",
    "zip_crc_off_in_this_thread",
    "check_ddp",
    "ddp_bucket_assignment",
    "ddp_has_rebuilt",
    "ddp_hooks",
    "ddp_rebuild_limits",
    "ddp_remove_hooks",
    "abort_process_groups",
    "fsdp_rebind_groups",
    "check_all",
]


class TorchAPIError(CheckpointError):
    """The installed torch lacks (or reshaped) a private API steadytrain relies on."""


def _torch_requirement() -> str:
    """The torch requirement steadytrain declares (e.g. ``torch==2.13.0``), or ''."""
    try:
        from importlib.metadata import requires

        for req in requires("steadytrain") or []:
            if req.replace(" ", "").startswith("torch") and not req.startswith("torch-"):
                return req.split(";")[0].strip()
    except Exception:  # noqa: BLE001 - only a hint for the message; never hide the real error
        pass
    return ""


def _fail(api: str, why: str, problem: str) -> TorchAPIError:
    from steadytrain import __version__

    wanted = _torch_requirement()
    pin = f"install the declared {wanted}" if wanted else "install the torch it was tested with"
    return TorchAPIError(
        f"steadytrain {__version__} needs {api} ({why}), which torch {torch.__version__} "
        f"{problem}; {pin} or upgrade steadytrain (the private torch APIs it uses are listed "
        f"in steadytrain/checkpoint/torch_private.py)"
    )


def _attr(module: str, path: str, api: str, why: str) -> Any:
    """``module.path`` (dotted), or TorchAPIError naming ``api``."""
    try:
        obj: Any = importlib.import_module(module)
    except ImportError:
        raise _fail(api, why, f"does not have (no module {module})") from None
    for part in path.split("."):
        if not hasattr(obj, part):
            raise _fail(api, why, "does not have")
        obj = getattr(obj, part)
    return obj


# -- torch._weights_only_unpickler ---------------------------------------------------------
_UNPICKLER = "torch._weights_only_unpickler.Unpickler"
_UNPICKLER_WHY = "to read a tensor's layout from its torch.save pickle without its data"


@functools.cache
def _unpickler_class() -> type:
    cls = _attr("torch._weights_only_unpickler", "Unpickler", _UNPICKLER, _UNPICKLER_WHY)
    params = inspect.signature(cls.__init__).parameters
    if "encoding" not in params or not callable(getattr(cls, "load", None)):
        raise _fail(_UNPICKLER, _UNPICKLER_WHY, "changed (no encoding= or load())")
    if not callable(getattr(cls, "persistent_load", None)):
        raise _fail(f"{_UNPICKLER}.persistent_load", _UNPICKLER_WHY, "does not have")
    return cls


def unpickle_weights_only(data: bytes, persistent_load: Callable[[Any], Any]) -> Any:
    """Unpickle ``data`` with torch's weights-only unpickler, storages via ``persistent_load``."""
    unpickler = _unpickler_class()(io.BytesIO(data), encoding="utf-8")
    unpickler.persistent_load = persistent_load
    return unpickler.load()


# -- TypedStorage(_internal=True) ----------------------------------------------------------
_TYPED = "torch.storage.TypedStorage(_internal=True)"
_TYPED_WHY = "to hand the weights-only unpickler storages the way torch.load does"


@functools.cache
def _typed_storage_class() -> type:
    cls = _attr("torch.storage", "TypedStorage", _TYPED, _TYPED_WHY)
    params = inspect.signature(cls.__new__).parameters
    if not {"wrap_storage", "dtype", "_internal"} <= set(params):
        raise _fail(_TYPED, _TYPED_WHY, "changed (no wrap_storage=/dtype=/_internal=)")
    return cls


def typed_storage(untyped: Any, dtype: torch.dtype) -> Any:
    """A ``TypedStorage`` view of ``untyped`` as ``dtype`` (no deprecation warning)."""
    return _typed_storage_class()(wrap_storage=untyped, dtype=dtype, _internal=True)


# -- FileSystemReader.storage_data ---------------------------------------------------------
_STORAGE = "torch.distributed.checkpoint.FileSystemReader.storage_data"
_STORAGE_WHY = "to read each tensor's bytes from its place in the .distcp file"
_STORAGE_FIELDS = ("relative_path", "offset", "length", "transform_descriptors")


class StorageInfo(Protocol):
    """Where DCP stored one item (torch's private ``_StorageInfo``)."""

    relative_path: str
    offset: int
    length: int
    transform_descriptors: Sequence[str] | None


@functools.cache
def _check_storage_info() -> None:
    info = _attr("torch.distributed.checkpoint.filesystem", "_StorageInfo", _STORAGE, _STORAGE_WHY)
    fields = {f.name for f in dataclasses.fields(info)} if dataclasses.is_dataclass(info) else set()
    missing = [f for f in _STORAGE_FIELDS if f not in fields]
    if missing:
        raise _fail(_STORAGE, _STORAGE_WHY, f"changed (_StorageInfo has no {missing})")


def storage_infos(reader: Any) -> Mapping[Any, StorageInfo]:
    """``reader.storage_data`` of a ``FileSystemReader`` that DCP has set up and asked to
    read something (so the mapping cannot legitimately be empty)."""
    _check_storage_info()
    data = getattr(reader, "storage_data", None)
    if not isinstance(data, Mapping):
        raise _fail(_STORAGE, _STORAGE_WHY, f"changed (a {type(data).__name__}, not a mapping)")
    if not data:
        raise _fail(_STORAGE, _STORAGE_WHY, "no longer fills in set_up_storage_reader")
    sample = next(iter(data.values()))
    if not all(hasattr(sample, f) for f in _STORAGE_FIELDS):
        raise _fail(_STORAGE, _STORAGE_WHY, f"changed (a {type(sample).__name__} entry)")
    return data


# -- AsyncStager._synchronize_after_execute ------------------------------------------------
_STAGER = "torch.distributed.checkpoint.staging.AsyncStager._synchronize_after_execute"
_STAGER_WHY = "to pass an already staged state dict to dcp.async_save without a second copy"


class IdentityStager:
    """The state dict is already staged into our reusable buffers: DCP must not copy again.

    Implements DCP's ``AsyncStager`` protocol. ``should_synchronize_after_execute`` is what
    ``async_save`` reads; ``_synchronize_after_execute`` is what the protocol's default
    property reads, set too so either way DCP does not wait on staging we already finished.
    """

    _synchronize_after_execute = False
    should_synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


@functools.cache
def _check_stager() -> None:
    proto = _attr("torch.distributed.checkpoint.staging", "AsyncStager", _STAGER, _STAGER_WHY)
    if not hasattr(proto, "_synchronize_after_execute"):
        raise _fail(_STAGER, _STAGER_WHY, "does not have")
    if not hasattr(proto, "should_synchronize_after_execute"):
        raise _fail(f"{_STAGER} (should_synchronize_after_execute)", _STAGER_WHY, "dropped")
    if not isinstance(IdentityStager(), proto):
        raise _fail(_STAGER, _STAGER_WHY, "changed (AsyncStager needs more methods)")
    save = _attr("torch.distributed.checkpoint", "async_save", _STAGER, _STAGER_WHY)
    if "async_stager" not in inspect.signature(save).parameters:
        raise _fail(_STAGER, _STAGER_WHY, "changed (async_save takes no async_stager=)")


def identity_stager() -> IdentityStager:
    """An ``IdentityStager`` for ``dcp.async_save(async_stager=...)``, after the check."""
    _check_stager()
    return IdentityStager()


# -- DCP's checkpoint daemon (async_save with AsyncCheckpointerType.PROCESS) -------------
_DAEMON_MODULE = "torch.distributed.checkpoint._async_process_executor"
_DAEMON = f"{_DAEMON_MODULE}._CHECKPOINT_PROCESS"
_DAEMON_WHY = "to notice that DCP's checkpoint daemon died and start a new one"


@functools.cache
def _daemon_module() -> Any:
    _attr(_DAEMON_MODULE, "_CHECKPOINT_PROCESS", _DAEMON, _DAEMON_WHY)  # None until a save
    return importlib.import_module(_DAEMON_MODULE)


def _daemon_process(daemon: Any) -> Any:
    proc = getattr(daemon, "_save_process", None)
    if not all(hasattr(proc, a) for a in ("is_alive", "pid", "exitcode", "join", "kill")):
        raise _fail(f"{_DAEMON}._save_process", _DAEMON_WHY, "changed (not a Process)")
    return proc


def checkpoint_daemon() -> tuple[int | None, int | None] | None:
    """(pid, exit code) of DCP's checkpoint daemon in this process; the exit code is None
    while it runs. None when no daemon was started (or it was forgotten)."""
    daemon = _daemon_module()._CHECKPOINT_PROCESS
    if daemon is None:
        return None
    proc = _daemon_process(daemon)
    return proc.pid, (None if proc.is_alive() else proc.exitcode)


def forget_checkpoint_daemon(timeout_s: float = 5.0) -> None:
    """Forget DCP's daemon, killing it if it still runs (its gloo group may be broken by a
    dead peer): the next ``async_save(PROCESS)`` starts a new one. Every rank must do this
    together, since starting daemons is collective."""
    module = _daemon_module()
    daemon, module._CHECKPOINT_PROCESS = module._CHECKPOINT_PROCESS, None
    if daemon is None:
        return
    proc = _daemon_process(daemon)
    if proc.is_alive():
        proc.kill()
    proc.join(timeout_s)


# -- _StorageInfo / _StoragePrefix, from a writer ------------------------------------------
_WRITES = "torch.distributed.checkpoint.filesystem._StorageInfo and _StoragePrefix"
_WRITES_WHY = "to record where a raw tensor record sits in its .distcp file"


@functools.cache
def _storage_classes() -> tuple[type, type]:
    _check_storage_info()
    fs = "torch.distributed.checkpoint.filesystem"
    prefix = _attr(fs, "_StoragePrefix", _WRITES, _WRITES_WHY)
    if not dataclasses.is_dataclass(prefix) or "prefix" not in {
        f.name for f in dataclasses.fields(prefix)
    }:
        raise _fail(_WRITES, _WRITES_WHY, "changed (_StoragePrefix has no prefix)")
    return _attr(fs, "_StorageInfo", _WRITES, _WRITES_WHY), prefix


def storage_info(
    relative_path: str, offset: int, length: int, descriptors: Sequence[str] | None
) -> StorageInfo:
    """DCP's record of one item: in ``relative_path`` at ``offset``, ``length`` bytes."""
    info = _storage_classes()[0]
    return info(
        relative_path=relative_path,
        offset=offset,
        length=length,
        transform_descriptors=descriptors,
    )


def file_prefix(plan: Any) -> str:
    """The file name prefix DCP's global plan gave this rank (``__R_``)."""
    prefix = plan.storage_data
    if not isinstance(prefix, _storage_classes()[1]):
        raise _fail(_WRITES, _WRITES_WHY, f"changed (plan.storage_data is {type(prefix)})")
    return str(prefix.prefix)


# -- FileSystemWriter.fs -------------------------------------------------------------------
_WRITER_FS = "torch.distributed.checkpoint.FileSystemWriter.fs"
_WRITER_FS_WHY = "to checksum each checkpoint file while DCP writes it, not by reading it back"


@functools.cache
def _check_writer_fs() -> type:
    base = _attr(
        "torch.distributed.checkpoint.filesystem", "FileSystemBase", _WRITER_FS, _WRITER_FS_WHY
    )
    writer = _attr("torch.distributed.checkpoint", "FileSystemWriter", _WRITER_FS, _WRITER_FS_WHY)
    probe = writer("checkpoint-probe")  # constructing touches nothing on disk
    if not isinstance(getattr(probe, "fs", None), base):
        raise _fail(_WRITER_FS, _WRITER_FS_WHY, "changed (no FileSystemBase in .fs)")
    return writer


def file_system_writer(path: str, fs: Any, cls: type | None = None, **kwargs: Any) -> Any:
    """``FileSystemWriter(path, **kwargs)`` (or its subclass ``cls``) that creates, renames
    and removes its files through ``fs`` (a DCP ``filesystem.FileSystem``)."""
    base = _check_writer_fs()
    writer = (cls or base)(path, **kwargs)
    writer.fs = fs
    writer.path = fs.init_path(path)
    return writer


# -- torch.utils.serialization.config: save.compute_crc32, per thread --------------------
_CRC = "torch.utils.serialization.config save.compute_crc32, set per thread"
_CRC_WHY = "to skip torch.save's zip CRC-32 in a checkpoint's writing thread and nowhere else"
_CRC_KEY = "save.compute_crc32"
_crc_warned = False


@functools.cache
def _check_crc_scope() -> None:
    """The CRC setting must be per thread, or turning it off would reach every thread's
    ``torch.save``: its override must be a ``ContextVar`` (one value per thread's context),
    and setting it inside an empty ``Context`` must leave this thread's value alone."""
    config = _attr("torch.utils.serialization", "config", _CRC, _CRC_WHY)
    entry = getattr(config, "_config", {}).get(_CRC_KEY)
    if not isinstance(getattr(entry, "user_override", None), contextvars.ContextVar):
        raise _fail(_CRC, _CRC_WHY, "changed (the setting is no longer held per thread)")
    ser = torch.serialization
    before = ser.get_crc32_options()
    inside = contextvars.Context()
    inside.run(ser.set_crc32_options, not before)
    if inside.run(ser.get_crc32_options) == before or ser.get_crc32_options() != before:
        ser.set_crc32_options(before)
        raise _fail(_CRC, _CRC_WHY, "changed (set_crc32_options reaches other threads)")


@contextlib.contextmanager
def zip_crc_off_in_this_thread() -> Iterator[None]:
    """``torch.save`` without zip CRC-32 in the calling thread while the block runs; every
    other thread keeps its own setting (the CRC, unless its code turned it off).

    On a torch where the setting is not per thread the CRC stays on, with one warning: a
    slower save, never an archive without CRC written by someone else's ``torch.save``."""
    global _crc_warned
    try:
        _check_crc_scope()
    except TorchAPIError as exc:
        if not _crc_warned:
            _crc_warned = True
            logging.getLogger("steadytrain.checkpoint").warning(
                "checkpoint shards keep torch.save's zip CRC-32 (slower saves): %s", exc
            )
        yield
        return
    saved = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(saved)


# -- DDP's bucket layout (exact_ddp) --------------------------------------------------------
_DDP = "torch.distributed._compute_bucket_assignment_by_size"
_DDP_WHY = "to reduce a resumed run's first step in the gradient layout DDP rebuilds"


@functools.cache
def _check_ddp() -> tuple[Callable[..., Any], int]:
    assign = _attr("torch.distributed", "_compute_bucket_assignment_by_size", _DDP, _DDP_WHY)
    params = [torch.zeros(4), torch.zeros(2)]
    try:  # DDP's own call: tensors, limits, expect-sparse flags, a tensor order
        buckets, caps = assign(params, [1 << 20], [], [0, 1])
    except Exception as e:
        raise _fail(_DDP, _DDP_WHY, f"changed ({type(e).__name__}: {e})") from None
    if [list(b) for b in buckets] != [[0, 1]] or len(caps) != 1:
        raise _fail(_DDP, _DDP_WHY, f"changed (returned {buckets!r}, {caps!r})")
    name = "torch.distributed._DEFAULT_FIRST_BUCKET_BYTES"
    first = _attr("torch.distributed", "_DEFAULT_FIRST_BUCKET_BYTES", name, _DDP_WHY)
    if not isinstance(first, int):
        raise _fail(name, _DDP_WHY, "changed (not an int)")
    return assign, first


def check_ddp() -> None:
    """TorchAPIError unless this torch has what ``exact_ddp`` needs to emulate DDP's layout."""
    _check_ddp()


def ddp_bucket_assignment(
    params: Sequence[torch.Tensor], limits: Sequence[int]
) -> tuple[list[list[int]], list[int]]:
    """DDP's grouping of ``params`` (in that order) into buckets under ``limits``: positions
    in ``params`` per bucket, and each bucket's cap."""
    buckets, caps = _check_ddp()[0](list(params), list(limits), [], list(range(len(params))))
    return [list(b) for b in buckets], list(caps)


def ddp_has_rebuilt(ddp: Any) -> bool | None:
    """Whether ``ddp`` has rebuilt its gradient buckets; None where this torch's DDP does not
    say."""
    flag = getattr(ddp, "_has_rebuilt_buckets", None)
    return None if flag is None else bool(flag)


def ddp_hooks(ddp: Any) -> list[Any]:
    """The communication hooks registered on ``ddp`` (DDP's mixed precision registers one)."""
    return list(getattr(ddp, "_comm_hooks", None) or [])


def ddp_rebuild_limits(ddp: Any) -> list[int]:
    """The bucket caps DDP's rebuild will use for ``ddp``."""
    cfg: Any = getattr(ddp, "_bucket_config", None)
    if cfg is None:  # torch before the bucket config: the default first bucket cap
        return [_check_ddp()[1], int(ddp.bucket_bytes_cap)]
    _, rebuild = cfg.compute_bucket_size_limits(
        static_graph=ddp.static_graph, find_unused_parameters=ddp.find_unused_parameters
    )
    return list(rebuild) or [cfg.first_bucket_bytes_cap, cfg.bucket_bytes_cap]


def ddp_remove_hooks(ddp: Any) -> bool:
    """Take ``ddp``'s reducer hooks off its parameters (a DDP about to be dropped); whether
    this torch could. Anything but a DDP with a reducer: False, nothing done."""
    remove = getattr(getattr(ddp, "reducer", None), "_remove_autograd_hooks", None)
    if remove is None:
        return False
    remove()
    return True


def abort_process_groups() -> Callable[[], None] | None:
    """torch's call that aborts every process group's communicators (NCCL), or None."""
    import torch.distributed.distributed_c10d as c10d

    return getattr(c10d, "_abort_process_group", None)


# -- FSDP2 over a renewed default group (in-place recovery, run_inplace.py) ----------------
_FSDP = "FSDPParamGroup.mesh_info.shard_process_group"
_FSDP_WHY = "to point an FSDP2 module at the default group an in-place regroup formed again"


def fsdp_rebind_groups(modules: Sequence[torch.nn.Module], old_name: str) -> str | None:
    """Point every FSDP2 module in ``modules`` at the current default group; why not (None:
    done). FSDP2 resolves its mesh's groups by name (the new default group is named as the
    old one: ``destroy_process_group`` resets c10d's group count), but each parameter group
    keeps the group object it resolved at ``fully_shard`` (``shard_process_group``) and a
    separate reduce-scatter group, if one was set. Only a 1-D mesh over the old default
    group ``old_name`` is rebound; anything else is refused before anything is changed."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    infos = []
    for module in modules:
        for sub in module.modules():
            if not isinstance(sub, FSDPModule):
                continue
            group = getattr(sub._get_fsdp_state(), "_fsdp_param_group", None)  # noqa: SLF001
            if group is None:  # a root without parameters of its own
                continue
            for info in (group.mesh_info, group.post_forward_mesh_info):
                if info is None:
                    continue
                names = list(getattr(info.mesh, "_dim_group_names", None) or [])
                if not hasattr(info, "shard_process_group") or names != [old_name]:
                    return (
                        f"an FSDP2 module is sharded over {names or 'an unknown mesh'}, not the "
                        f"default group {old_name!r} alone ({_FSDP}; {_FSDP_WHY})"
                    )
                if getattr(info, "reduce_scatter_process_group", None) is not None:
                    return "an FSDP2 module has a separate reduce-scatter group"
                infos.append(info)
    if dist.group.WORLD is None or dist.group.WORLD.group_name != old_name:
        return f"the new default group is not named {old_name!r} as the old one was"
    for info in infos:
        info.shard_process_group = info.mesh.get_group(info.shard_mesh_dim)
    return None


def check_all() -> list[str]:
    """Check every fenced API now; the names checked (TorchAPIError on the first failure)."""
    _unpickler_class()
    _typed_storage_class()
    _check_storage_info()
    _check_stager()
    _daemon_module()
    _check_writer_fs()
    _storage_classes()
    _check_crc_scope()
    _check_ddp()
    return [_UNPICKLER, _TYPED, _STORAGE, _STAGER, _DAEMON, _WRITER_FS, _WRITES, _CRC, _DDP]
