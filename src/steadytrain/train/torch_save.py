"""The classic baseline: one ``torch.save`` file written synchronously by rank 0 (nanoGPT).

``checkpoint.engine = "torch_save"`` swaps the Checkpointer for this, for benchmarks that
compare what asynchronous sharded checkpoints buy. Same calls (``restore_latest``,
``maybe_save``, ``save``, ``wait``, ``close``, ``last_event``) and the same ledger events, so
the goodput ledger measures both the same way. Every rank blocks until rank 0 has written
and fsync'd ``DIR/ckpt.pt`` (published atomically by ``storage.publish``, so a crash
mid-save keeps the previous one). DDP only: model and optimizer state are full on every rank; the loader state is
rank-independent; RNG state is not saved (the reference model has no dropout by default).

Loading is safe against a hostile ``ckpt.pt`` as far as torch allows: it is read with
``torch.load(weights_only=True)`` (torch's restricted unpickler: tensors, containers and
plain values, never an arbitrary callable; a pickle that calls ``os.system`` is refused,
naming the file), only when it is a regular file, and only when it matches its checksum
file ``ckpt.pt.xxh3`` (docs/format.md, "torch_save checksum"). The checksum file is written
before ``ckpt.pt`` is renamed into place and lists the new and the previous digest, then
again with the new one only, so a crash between the two still leaves a pair that verifies.
A ``ckpt.pt`` without one (written by an older steadytrain) loads, with a warning.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from steadytrain.checkpoint.regular import inside, open_regular, read_regular
from steadytrain.errors import CheckpointError
from steadytrain.storage.publish import Hasher, atomic_writer, publish_bytes

__all__ = ["TorchSaveCheckpointer", "SUM_SUFFIX"]

log = logging.getLogger("steadytrain.checkpoint")
SUM_SUFFIX = ".xxh3"  # ckpt.pt.xxh3: the checksum file beside ckpt.pt
SUM_FORMAT = "steadytrain-torch-save-checksum"
_MAX_SUM_BYTES = 4096  # a real one is ~150 bytes


class TorchSaveCheckpointer:
    def __init__(
        self,
        directory: str,
        every_steps: int | None,
        on_event: Callable[[dict], None] | None = None,
    ) -> None:
        self.directory = directory
        self.every_steps = every_steps
        self.on_event = on_event
        self.last_event: dict[str, Any] | None = None
        self.path = os.path.join(directory, "ckpt.pt")
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        os.makedirs(directory, exist_ok=True)

    def _emit(self, event: dict[str, Any]) -> None:
        self.last_event = event
        if self.on_event is not None:
            self.on_event(event)

    def restore_latest(self, states: dict[str, Any]) -> int:
        t0 = time.perf_counter()
        if not os.path.lexists(self.path):
            return 0
        saved = self._load()
        for name, obj in states.items():
            obj.load_state_dict(saved["states"][name])
        step = int(saved["step"])
        self._emit(
            {
                "type": "restore",
                "step": step,
                "restore_s": time.perf_counter() - t0,
                "path": self.path,
                "skipped": [],
            }
        )
        return step

    def _load(self) -> dict[str, Any]:
        """``ckpt.pt``, checked against its checksum file, unpickled weights-only."""
        if not inside(self.path, self.directory):
            raise CheckpointError(
                f"{self.path}: a link to {os.path.realpath(self.path)}, outside the checkpoint "
                "directory; not read. Remove the link or copy the file in"
            )
        fd = open_regular(self.path)  # a FIFO or a device: CheckpointError naming it
        with open(fd, "rb", closefd=True) as f:
            data = f.read()
        accept = self._accepted()
        size, digest = len(data), Hasher()
        digest.update(data)
        if accept is None:
            log.warning(
                "%s has no checksum file %s (written by an older steadytrain): loaded "
                "weights-only without an integrity check; the next save writes one",
                self.path,
                self.sum_path,
            )
        elif {"size": size, "xxh3_64": digest.digest_hex()} not in accept:
            raise CheckpointError(
                f"{self.path}: {size} bytes with xxh3-64 {digest.digest_hex()}, which "
                f"{self.sum_path} does not list: the file is damaged or was replaced. Restore "
                "it from a copy, or move it away to start this run from scratch"
            )
        try:  # torch's restricted unpickler: never runs code a pickle names
            saved = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CheckpointError(
                f"{self.path}: refused by torch's weights-only loader ({first[:300]}): it "
                "is not a checkpoint this engine wrote (it may try to run code). Only load "
                "checkpoints your own jobs wrote; move it away to start from scratch"
            ) from None
        if not (
            isinstance(saved, dict)
            and isinstance(saved.get("states"), dict)
            and type(saved.get("step")) is int
            and saved["step"] >= 0
        ):
            raise CheckpointError(
                f"{self.path}: not a torch_save checkpoint of this engine (a dict with an "
                "integer step and a states dict); move it away to start from scratch"
            )
        return saved

    @property
    def sum_path(self) -> str:
        return self.path + SUM_SUFFIX

    def _accepted(self) -> list[dict[str, Any]] | None:
        """The (size, digest) pairs ``ckpt.pt.xxh3`` accepts; None when there is none.
        A malformed one is a CheckpointError naming it (never trusted, never a traceback)."""
        if not os.path.lexists(self.sum_path):
            return None
        raw = read_regular(self.sum_path, limit=_MAX_SUM_BYTES + 1)
        try:
            doc = json.loads(raw) if len(raw) <= _MAX_SUM_BYTES else None
        except (ValueError, RecursionError):
            doc = None
        accept = doc.get("accept") if isinstance(doc, dict) else None
        if (
            not isinstance(doc, dict)
            or doc.get("format") != SUM_FORMAT
            or not isinstance(accept, list)
            or not 1 <= len(accept) <= 4
            or not all(_is_entry(e) for e in accept)
        ):
            raise CheckpointError(
                f"{self.sum_path}: not a valid checksum file for {self.path} (JSON "
                f'{{"format": "{SUM_FORMAT}", "accept": [{{"size", "xxh3_64"}}, ...]}}); '
                "delete it to load the checkpoint without an integrity check"
            )
        return [{"size": e["size"], "xxh3_64": e["xxh3_64"]} for e in accept]

    def _write_sum(self, accept: list[dict[str, Any]]) -> None:
        doc = {"format": SUM_FORMAT, "version": 1, "accept": accept}
        publish_bytes(self.sum_path, json.dumps(doc, sort_keys=True).encode())

    def _previous(self) -> list[dict[str, Any]]:
        """The digest(s) the current ``ckpt.pt`` verifies against (hashed once if it has no
        checksum file yet): kept acceptable until the new file is in place."""
        try:
            accept = self._accepted()
        except CheckpointError:
            accept = None  # rewritten below from the file itself
        if accept is not None:
            return accept[:2]
        if not os.path.isfile(self.path):
            return []
        h = Hasher()
        with open(open_regular(self.path), "rb", closefd=True) as f:
            while piece := f.read(8 << 20):
                h.update(piece)
        return [{"size": h.size, "xxh3_64": h.digest_hex()}]

    def maybe_save(self, step: int, states: dict[str, Any], tokens_seen: int = 0) -> float:
        if not self.every_steps or step % self.every_steps:
            return 0.0
        return self.save(step, states, tokens_seen)

    def save(self, step: int, states: dict[str, Any], tokens_seen: int = 0) -> float:
        t0 = time.perf_counter()
        if self.rank == 0:
            payload = {
                "step": step,
                "tokens_seen": tokens_seen,
                "states": {name: obj.state_dict() for name, obj in states.items()},
            }
            previous, h = self._previous(), Hasher()
            with atomic_writer(self.path, hasher=h) as f:
                torch.save(payload, f)
                new = {"size": h.size, "xxh3_64": h.digest_hex()}
                # Before the rename: a crash on either side of it leaves a pair that verifies.
                self._write_sum([new, *(p for p in previous if p != new)])
            self._write_sum([new])
        if dist.is_initialized():
            dist.barrier()  # nobody goes on before the file is durable
        block_s = time.perf_counter() - t0
        self._emit(
            {
                "type": "checkpoint",
                "step": step,
                "block_s": block_s,
                "durable_s": block_s,
                "ok": True,
                "path": self.path,
                "error": None,
            }
        )
        return block_s

    def wait(self) -> float:
        return 0.0

    def close(self) -> None:
        pass


def _is_entry(e: Any) -> bool:
    return (
        isinstance(e, dict)
        and type(e.get("size")) is int
        and e["size"] >= 0
        and isinstance(e.get("xxh3_64"), str)
        and len(e["xxh3_64"]) == 16
    )
