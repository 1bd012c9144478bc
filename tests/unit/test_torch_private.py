"""The private torch APIs steadytrain relies on (checkpoint/torch_private.py), each exercised.

When a torch upgrade renames or reshapes one of them, this file is where it shows, with the
API named, instead of a slow path or an AttributeError deep inside a restore.
"""

from __future__ import annotations

import io
import re
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import steadytrain
from steadytrain.checkpoint import torch_private as tp
from steadytrain.checkpoint.archive import tensor_layout
from steadytrain.errors import CheckpointError

SRC = Path(steadytrain.__file__).parent
_CHECKS = (
    tp._unpickler_class,
    tp._typed_storage_class,
    tp._check_storage_info,
    tp._check_stager,
    tp._daemon_module,
    tp._check_writer_fs,
    tp._storage_classes,
    tp._check_crc_scope,
    tp._check_ddp,
)


@pytest.fixture(autouse=True)
def _fresh_checks():
    """Each test sees the checks run against the torch it has (they are cached otherwise)."""
    for check in _CHECKS:
        check.cache_clear()
    yield
    for check in _CHECKS:
        check.cache_clear()


def test_every_fenced_api_is_present_in_this_torch():
    assert len(tp.check_all()) == 9


def _pickle_of(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith("/data.pkl")]
        return zf.read(name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_weights_only_unpickler_and_typed_storage_rebuild_a_tensor_on_meta(dtype):
    src = torch.zeros(6, 10, dtype=dtype)[:, 2:7]  # a strided view: offset and strides
    seen = []

    def persistent_load(saved_id):
        _kind, storage_type, _key, _location, numel = saved_id
        seen.append(numel)
        storage = torch.UntypedStorage(numel * storage_type.dtype.itemsize, device="meta")
        return tp.typed_storage(storage, storage_type.dtype)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # TypedStorage must not warn: _internal=True works
        meta = tp.unpickle_weights_only(_pickle_of(src), persistent_load)
    assert seen == [60]
    assert type(meta) is torch.Tensor and meta.device.type == "meta"
    assert (meta.dtype, meta.shape, meta.stride()) == (dtype, src.shape, src.stride())
    assert meta.storage_offset() == src.storage_offset() == 2


def test_the_weights_only_unpickler_still_refuses_code():
    class Evil:
        def __reduce__(self):
            return (print, ("ran",))

    import pickle

    with pytest.raises(pickle.UnpicklingError):
        tp.unpickle_weights_only(pickle.dumps(Evil(), protocol=2), lambda pid: None)


def test_storage_infos_locate_every_item_in_the_distcp_files(tmp_path):
    state = {"w": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3, 4)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    reader = dcp.FileSystemReader(str(tmp_path))
    reader.set_up_storage_reader(reader.read_metadata(), True)
    infos = tp.storage_infos(reader)
    assert len(infos) == 2
    for index, info in infos.items():
        path = tmp_path / info.relative_path
        assert info.offset + info.length <= path.stat().st_size
        with open(path, "rb") as f:  # the record there is the tensor's torch.save archive
            meta, _at = tensor_layout(f.fileno(), info.offset, info.length)
        assert meta.shape == state[index.fqn].shape


def test_storage_infos_of_a_reader_dcp_did_not_set_up_is_a_clear_error(tmp_path):
    with pytest.raises(tp.TorchAPIError) as err:
        tp.storage_infos(dcp.FileSystemReader(str(tmp_path)))
    assert "FileSystemReader.storage_data" in str(err.value)
    assert isinstance(err.value, CheckpointError)


def test_identity_stager_hands_dcp_our_staged_dict_and_is_not_waited_on(tmp_path):
    calls = []

    class Recording(tp.IdentityStager):
        def stage(self, state_dict):
            calls.append(("stage", state_dict))
            return state_dict

        def synchronize_staging(self):
            calls.append(("synchronize_staging", None))

    tp.identity_stager()  # the protocol check
    staged = {"w": torch.arange(10.0)}
    fut = dcp.async_save(
        staged,
        storage_writer=dcp.FileSystemWriter(str(tmp_path)),
        async_stager=Recording(),
        no_dist=True,
    )
    fut.result()
    assert [name for name, _ in calls] == ["stage"]  # no copy, no wait on staging
    assert calls[0][1]["w"] is staged["w"]
    loaded = {"w": torch.zeros(10)}
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(str(tmp_path)), no_dist=True)
    assert torch.equal(loaded["w"], staged["w"])


def test_a_missing_private_api_names_torch_the_api_and_the_fix(monkeypatch):
    import torch._weights_only_unpickler as wou

    monkeypatch.delattr(wou, "Unpickler")
    with pytest.raises(tp.TorchAPIError) as err:
        tp.unpickle_weights_only(b"", lambda pid: None)
    msg = str(err.value)
    assert f"torch {torch.__version__}" in msg
    assert "torch._weights_only_unpickler.Unpickler" in msg
    assert f"steadytrain {steadytrain.__version__}" in msg and "upgrade steadytrain" in msg
    with pytest.raises(tp.TorchAPIError):
        tp.check_all()


def test_a_stager_protocol_without_the_private_flag_is_refused(monkeypatch):
    from torch.distributed.checkpoint import staging

    monkeypatch.delattr(staging.AsyncStager, "_synchronize_after_execute")
    with pytest.raises(tp.TorchAPIError, match="_synchronize_after_execute"):
        tp.identity_stager()


def test_a_writer_without_a_file_system_hook_is_refused(monkeypatch):
    from torch.distributed.checkpoint import filesystem

    monkeypatch.setattr(filesystem.FileSystemWriter, "__init__", lambda self, path: None)
    with pytest.raises(tp.TorchAPIError, match="FileSystemWriter.fs"):
        tp.file_system_writer("ck", filesystem.FileSystem())


def _crcs(t: torch.Tensor) -> set[int]:
    """The zip CRC-32 fields of ``torch.save(t)``'s records (0 where torch skipped them)."""
    buf = io.BytesIO()
    torch.save(t, buf)
    with zipfile.ZipFile(buf) as zf:
        return {i.CRC for i in zf.infolist() if i.file_size}


def test_zip_crc_is_off_only_in_the_thread_that_asked_and_only_inside_the_block():
    """The reason the CRC switch may exist at all: a torch.save on another thread while a
    checkpoint writes keeps its CRC (a process-wide switch would silently drop it)."""
    import threading

    inside, done = threading.Event(), threading.Event()
    seen: dict[str, set[int]] = {}

    def writer() -> None:
        with tp.zip_crc_off_in_this_thread():
            seen["writer"] = _crcs(torch.arange(100.0))
            inside.set()
            done.wait(30)  # still inside the block while the main thread saves
        seen["writer_after"] = _crcs(torch.arange(100.0))

    t = threading.Thread(target=writer)
    t.start()
    assert inside.wait(30)
    seen["other_thread_meanwhile"] = _crcs(torch.arange(100.0))
    done.set()
    t.join(30)
    assert seen["writer"] == {0}
    assert 0 not in seen["other_thread_meanwhile"] and seen["other_thread_meanwhile"]
    assert 0 not in seen["writer_after"]
    assert torch.serialization.get_crc32_options()


def test_a_caller_that_turned_the_crc_off_keeps_it_off_after_the_block():
    torch.serialization.set_crc32_options(False)
    try:
        with tp.zip_crc_off_in_this_thread():
            pass
        assert not torch.serialization.get_crc32_options()
    finally:
        torch.serialization.set_crc32_options(True)


def test_a_process_wide_crc_setting_is_refused_and_the_crc_stays_on(monkeypatch, caplog):
    """On a torch whose CRC setting reaches every thread, checkpoints keep the CRC."""
    from torch.utils.serialization import config

    class OneValueForAllThreads:  # what a ContextVar replaced by a plain attribute would do
        def __init__(self) -> None:
            self.value = True

        def get(self) -> bool:
            return self.value

        def set(self, value: bool) -> None:
            self.value = value

    monkeypatch.setattr(
        config._config["save.compute_crc32"], "user_override", OneValueForAllThreads()
    )
    with pytest.raises(tp.TorchAPIError, match="compute_crc32"):
        tp.check_all()
    monkeypatch.setattr(tp, "_crc_warned", False)
    with caplog.at_level("WARNING", logger="steadytrain.checkpoint"):
        with tp.zip_crc_off_in_this_thread():
            crcs = _crcs(torch.arange(100.0))
    assert 0 not in crcs
    assert "keep torch.save's zip CRC-32" in caplog.text


# Private torch names, wherever they appear under src/: only the fence may use them.
_PRIVATE = re.compile(
    r"torch\.[A-Za-z_.]*\._[a-z]|from torch[\w.]* import _|_weights_only_unpickler"
    r"|\.storage_data\b|_synchronize_after_execute|_internal=True|_fsspec_filesystem"
    r"|\bdist\._[a-z_A-Z]|_has_rebuilt_buckets|_bucket_config|_comm_hooks"
    r"|_compute_bucket_assignment|_DEFAULT_FIRST_BUCKET"
)


def test_no_module_but_the_fence_uses_private_torch_names():
    offenders = [
        f"{path.relative_to(SRC)}:{n}"
        for path in sorted(SRC.rglob("*.py"))
        if path.name != "torch_private.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if _PRIVATE.search(line)
    ]
    assert offenders == []


def test_ddp_bucket_assignment_groups_as_the_caps_say():
    """exact_ddp's emulation of DDP's rebuild rests on DDP's own grouping function."""
    params = [torch.zeros(256), torch.zeros(256), torch.zeros(256)]  # 1 KiB each
    buckets, caps = tp.ddp_bucket_assignment(params, [1024, 2048])
    assert buckets == [[0], [1, 2]]  # the first bucket fills its 1 KiB cap, then 2 KiB
    assert caps == [1024, 2048]
    assert tp.ddp_bucket_assignment(params, [1 << 20])[0] == [[0, 1, 2]]


def test_ddp_attributes_are_read_from_a_real_ddp(tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(torch.nn.Linear(3, 2))
        assert tp.ddp_has_rebuilt(ddp) is False
        assert tp.ddp_hooks(ddp) == []
        limits = tp.ddp_rebuild_limits(ddp)
        assert limits and all(isinstance(x, int) and x > 0 for x in limits)
        ddp(torch.ones(1, 3)).sum().backward()
        ddp(torch.ones(1, 3)).sum().backward()
        assert tp.ddp_has_rebuilt(ddp) is True
        del ddp  # before the group: see _leave
    finally:
        _leave()


def _leave() -> None:
    """Destroy the group once every DDP over it is gone. A DDP freed after the group holds
    its last reference, and frees it with the GIL held, joining gloo's threads while one of
    them may still wait for the GIL to free the last collective's work: a hang, seen in a
    quick run (``Recovery.close`` and the training loop keep the same order)."""
    import gc

    import torch.distributed as dist

    gc.collect()
    dist.destroy_process_group()


@pytest.mark.parametrize("remove", [True, False])
def test_a_dropped_ddp_whose_hooks_are_removed_reduces_nothing_more(tmp_path, remove):
    """In-place recovery builds a new DDP over the module of one whose group died; the old
    reducer (its forward ran, its backward never finished) must not reduce the new one's
    backward on its dead group. The ``remove=False`` case shows what the removal prevents."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    def counting(calls):
        def hook(state, bucket):
            calls.append(1)
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

        return hook

    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "s"), 1), rank=0, world_size=1
    )
    try:
        module = torch.nn.Linear(3, 2)
        old, new = [], []
        ddp = DistributedDataParallel(module)
        ddp.register_comm_hook(None, counting(old))
        ddp(torch.ones(1, 3))  # the forward of the step that failed
        if remove:
            assert tp.ddp_remove_hooks(ddp) is True
        again = DistributedDataParallel(module)
        again.register_comm_hook(None, counting(new))
        again(torch.ones(1, 3)).sum().backward()
        assert new == [1]
        assert (old == []) is remove
        assert tp.ddp_remove_hooks(module) is False  # not a DDP: nothing to remove
        assert callable(tp.abort_process_groups())  # the NCCL branch's abort, in this torch
        del ddp, again
    finally:
        _leave()
