"""The memory tier: a recovery point every K steps in node-local memory and on a peer.

One generation, in order: the loop thread stages the states into reused buffers (``Stager``;
pinned, on a side CUDA stream when CUDA is there) and hands them to a background thread,
so the step is blocked for the copy only; the thread lays out the file, agrees with every
rank (one all-gather on the tier's own gloo group: sizes, errors, budgets), fills the own
copy straight into its file (``Store.reserve``: the pruned generation's file, mapped; then
renamed), sends it to the peer from that mapping and receives the copies it keeps straight
into theirs, each verified before it is published. One copy of the staged bytes per file. At most one generation is in flight: a
due snapshot first waits for the previous one, and that wait counts as blocked time.

Any failure (a full /dev/shm, a peer gone, a state that cannot be stored) is a
``memory_snapshot`` event with ``ok: false`` and the error: training and durable
checkpoints go on. A refused budget, a memory directory that is not this user's alone
(``private.py``: checked at construction) and a tmpfs full for ``FULL_GENERATIONS``
generations in a row each turn the tier off for the run, on every rank at once, with one
such event that says why.

Every snapshot carries the run's nonce (``nonce``, set by the ``Checkpointer`` before the
first snapshot or restore; run_identity.py); a copy of another run is never restored.

Restore (``restore``): every rank scans its node's copies (verified, same run, job and
world size) and all agree, from one all-gather, on the newest step >= the newest durable commit
for which every rank's copy exists somewhere; owners without their own copy fetch it from
the lowest rank that holds one. Every rank verifies what it got and checks it against its
states, and all agree, before any live state is written; any doubt: durable. What any
rank passed over, and why, goes into the restore event's ``skipped`` on every rank (rank 0
records it in the ledger), not only into that rank's log.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from steadytrain.checkpoint import state as S
from steadytrain.checkpoint.memory import peers
from steadytrain.checkpoint.memory import snapshot as snap
from steadytrain.checkpoint.memory.auto import AutoInterval
from steadytrain.checkpoint.memory.config import MemoryConfig
from steadytrain.checkpoint.memory.plan import check_copy, choose
from steadytrain.checkpoint.memory.private import default_dir
from steadytrain.checkpoint.memory.restored import (
    Background,
    Damaged,
    bounded,
    give_back,
    owned,
    parse_copy,
)
from steadytrain.checkpoint.memory.store import (
    Store,
    budget_error,
    free_bytes,
    need_by_node,
    store_key,
)
from steadytrain.checkpoint.staging import Stager
from steadytrain.checkpoint.writer import FAILURES, Group
from steadytrain.errors import CheckpointError
from steadytrain.node import node_name

__all__ = ["MemoryTier"]

log = logging.getLogger("steadytrain.checkpoint")

_ATTEMPTS = 4  # memory plans tried at restore before durable checkpoints
# A tmpfs that was full for this many generations in a row turns the tier off. One or two
# are a passing squeeze (another job's burst, a file staged on the node, the page cache of
# a download): the next generation finds room again. Three in a row is a node that has no
# room for this job; from then on every snapshot would cost its staging and a warning for
# nothing.
FULL_GENERATIONS = 3
_FULL = (errno.ENOSPC, errno.EDQUOT)
_OFF = "the memory tier is off for this run; training and durable checkpoints go on"


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class MemoryTier:
    """Every rank constructs it, in the same order (one all-gather on ``pg``)."""

    def __init__(
        self, cfg: MemoryConfig, pg: Any, checkpoint_dir: str, job: str, mtbf_s: float = 0.0
    ) -> None:
        self.cfg, self.job = cfg, job
        self.auto = AutoInterval(mtbf_s, cfg.survives) if cfg.every_steps == "auto" else None
        self.group = Group(pg)
        self.rank, self.world = self.group.rank, self.group.world
        self.node = node_name()
        base = cfg.resolved_dir()
        self.store = Store(base, store_key(job, checkpoint_dir), private_base=base == default_dir())
        self.nonce: str | None = None  # the run's (the Checkpointer sets it): run_identity.py
        err, budget = None, 0
        self._usable = False  # the directories passed their checks: may be listed, removed
        try:
            self.store.prepare()  # every start: the directories are this user's alone
            self._usable = True
            budget = cfg.budget_bytes or free_bytes(self.store.root) // 2
        except CheckpointError as exc:  # private.PrivateDirError
            err = f"rank {self.rank} on {self.node}: {exc}"
        except OSError as exc:
            err = (
                f"rank {self.rank} on {self.node}: memory directory {self.store.root}: "
                f"{_why(exc)}; give checkpoint.memory.dir a writable node-local directory (a "
                "tmpfs such as /dev/shm)"
            )
        facts = self.group.all_gather((self.node, budget, err))
        self.pairing = peers.pair([f[0] for f in facts], cfg.peer)
        self.budgets = [f[1] for f in facts]
        errors = [f[2] for f in facts if f[2]]
        self.stager = Stager()  # its own reused buffers; pinned when CUDA is there
        self._spare: dict[int, Any] = {}  # images when a file cannot be had (by owner)
        self._thread: threading.Thread | None = None
        self._events: list[dict[str, Any]] = []
        self.last_step = 0  # the newest generation written here without error
        self.touched = False  # a failed memory restore wrote part of the live states
        self._sent: list[str] = []  # restore: copies this rank could not send as planned
        self._full = 0  # generations in a row this rank found its tmpfs full
        self._filled = False  # the generation in flight found it full
        # off on every rank together: a rank alone would leave its peer waiting for it
        self.off: str | None = None
        if errors:
            self._turn_off(0, f"memory tier off: {'; '.join(errors[:4])}; {_OFF}")

    def _turn_off(self, step: int, why: str) -> None:
        """Off for the run, said once: a warning and one ``memory_snapshot`` event."""
        self.off = why
        log.warning("%s", why)
        self._events.append(
            {"type": "memory_snapshot", "step": step, "ok": False, "block_s": 0.0, "error": why}
        )

    # -- snapshots ----------------------------------------------------------------------
    def due(self, step: int) -> bool:
        if self.off is not None or step <= 0:
            return False
        every = self.cfg.every_steps
        if self.auto is not None:
            landed = self._thread is None or not self._thread.is_alive()
            measuring = self.auto.due(step, landed)
            if measuring is not None:
                return measuring
            if self.auto.every is None:
                self.wait()  # the generation whose agreement chooses K (auto.py)
            every = self.auto.every or 1
        return every > 0 and step % every == 0

    def snapshot(self, step: int, states: dict[str, Any], tokens_seen: int = 0) -> float:
        """Stage ``states`` now and write the generation in the background; returns the
        seconds the caller was blocked (the previous generation's wait + staging)."""
        t0 = time.perf_counter()
        self.wait()
        t_stage = time.perf_counter()
        if self.off is not None:
            return t_stage - t0
        meta = {
            "run_nonce": self.nonce,
            "job": self.job,
            "step": step,
            "owner": self.rank,
            "world_size": self.world,
            "node": self.node,
            "tokens_seen": int(tokens_seen),
            "created": time.time(),
        }
        try:
            if self.nonce is None:  # the Checkpointer sets it first: a copy must name its run
                raise CheckpointError("no run nonce was set; this copy could never be restored")
            staged, copied = self._stage(S.dcp_state_dict(states))
            meta["json_states"], meta["rng"] = S.json_states(states), S.rng_state()
            err = None
        except FAILURES as exc:  # noqa: BLE001 - reported with the generation; training goes on
            staged, copied, err = None, None, f"rank {self.rank}: staging failed: {_why(exc)}"
        block_s = time.perf_counter() - t0
        measured = None
        if self.auto is not None:  # the cost measured is the staging, not the wait before
            measured = self.auto.started(t_stage, time.perf_counter() - t_stage)
        self._thread = threading.Thread(
            target=self._generation,
            args=(step, staged, meta, block_s, err, copied, measured),
            name=f"steadytrain-memory-{step}",
            daemon=True,
        )
        self._thread.start()
        return block_s

    def _stage(self, tree: Any) -> tuple[Any, Any]:
        """The staged tree, and the CUDA event its device-to-host copies complete at (None:
        they are complete). The loop's thread is blocked only while the copies are queued."""
        import torch

        if not torch.cuda.is_available():
            return self.stager.stage(tree), None
        # A side stream: the copies do not queue behind kernels launched after this point;
        # it first waits for the work that produced the states (the optimizer step).
        side = getattr(self, "_side", None) or torch.cuda.Stream()
        self._side = side
        training = torch.cuda.current_stream()
        side.wait_stream(training)
        with torch.cuda.stream(side):
            staged = self.stager.stage(tree, wait=False)
        if not self.stager.in_flight_devices():
            return staged, None
        copied = torch.cuda.Event()
        copied.record(side)
        # Whatever the loop queues next (the optimizer step that overwrites the sources)
        # runs after the copies, on the GPU: the loop's thread does not wait for them. The
        # background thread waits for ``copied`` before it reads the buffers.
        training.wait_stream(side)
        return staged, copied

    def _generation(
        self,
        step: int,
        staged: Any,
        meta: dict[str, Any],
        block_s: float,
        err: str | None,
        copied: Any = None,
        measured: dict[str, Any] | None = None,
    ) -> None:
        event: dict[str, Any] = {
            "type": "memory_snapshot",
            "step": step,
            "ok": False,
            "block_s": block_s,
            "write_s": 0.0,
            "peer_s": 0.0,
            "bytes": 0,
            "peer_bytes": 0,
            "error": "",
        }
        try:
            if copied is not None:
                copied.synchronize()  # the device-to-host copies queued by _stage
            event["error"] = self._run_generation(step, staged, meta, err, event, measured) or ""
        except FAILURES as exc:  # noqa: BLE001 - a broken side group: this generation fails
            event["error"] = f"rank {self.rank}: {_why(exc)}"
        if self.auto is not None:
            self.auto.landed(event["write_s"] + event["peer_s"])
            if measured is not None and self.auto.every is None:
                self.auto.every = 1  # the agreement never happened: snapshot every step
            if measured is not None:
                event["every_steps"] = self.auto.every
                if self.auto.chosen_from:
                    event["auto"] = self.auto.chosen_from
        event["ok"] = not event["error"]
        self._full = self._full + 1 if self._filled else 0
        if event["ok"]:
            self.last_step = step
        elif self.off is None and self._full <= 1:  # a full tmpfs: once, then the event
            log.warning(
                "memory snapshot of step %d failed (training goes on): %s", step, event["error"]
            )
        if self.off is not None and event["error"] == self.off:
            log.warning("%s", self.off)  # the tier turned off in this generation: said once
        self._events.append(event)

    def _run_generation(
        self,
        step: int,
        staged: Any,
        meta: dict[str, Any],
        err: str | None,
        event: dict,
        measured: dict[str, Any] | None = None,
    ) -> str | None:
        t0 = time.perf_counter()
        plan, self._filled = None, False
        if err is None:
            try:
                plan = snap.layout(meta, staged)
            except FAILURES as exc:  # noqa: BLE001 - a state the format cannot hold
                err = f"rank {self.rank}: {_why(exc)}"
        size = 0 if plan is None else plan.total
        if measured is not None and self.auto is not None:
            measured = {**measured, "landed_s": self.auto.landed_s}
        # every rank, every generation; "auto" measurements ride along (auto.py), and how
        # many generations in a row each rank found its tmpfs full
        gathered = self.group.all_gather((size, err, measured, self._full))
        if measured is not None and self.auto is not None:
            self.auto.choose([m for _, _, m, _ in gathered])
        full = [(r, n) for r, (_, _, _, n) in enumerate(gathered) if n >= FULL_GENERATIONS]
        if full:
            r, n = full[0]
            self.off = (
                f"memory tier off: the memory directory of {self.pairing.nodes[r]} (rank {r}) "
                f"was full for the last {n} generations in a row ({self.store.base}); give it "
                "more room (a larger /dev/shm) or lower checkpoint.memory.budget_bytes; " + _OFF
            )
            return self.off
        errors = [e for _, e, _, _ in gathered if e]
        if errors:
            return "; ".join(errors[:4])
        sizes = [s for s, _, _, _ in gathered]
        need = need_by_node(self.pairing.nodes, sizes, self.pairing.peer_of)
        for r, node in enumerate(self.pairing.nodes):
            if need[node] > self.budgets[r]:
                self.off = budget_error(node, need[node], self.budgets[r], self.store.base)
                return self.off
        assert plan is not None
        problems: list[str] = []
        # The own copy is filled straight into its file (one copy of the staged bytes); if
        # the file cannot be had, into a buffer, so the peer still gets its copy.
        image, tmp = self._reserve(self.rank, step, size, problems)
        snap.fill(plan, image)
        if tmp is not None:
            try:
                self.store.publish(tmp, self.rank, step)
                event["bytes"] = size
            except OSError as exc:
                problems.append(
                    f"rank {self.rank}: writing {self.store.path(self.rank, step)}: {_why(exc)}"
                )
        event["write_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        peer, owners = self.pairing.peer_of[self.rank], self.pairing.holds_for(self.rank)
        if peer is not None or owners:
            files: dict[int, str | None] = {}

            def into(owner: int, nbytes: int) -> Any:  # a received copy goes into its file
                buf, files[owner] = self._reserve(owner, step, nbytes, problems)
                return buf

            received = peers.exchange(self.group.pg, peer, image, owners, into, sizes, problems)
            for owner, buf in received.items():
                where = f"the copy of rank {owner} step {step} received by rank {self.rank}"
                tmp = files.get(owner)
                try:
                    snap.verify(buf, where)  # before its name exists
                    if tmp is not None:
                        self.store.publish(tmp, owner, step)
                        event["peer_bytes"] += len(buf)
                except (CheckpointError, OSError) as exc:
                    if tmp is not None:
                        self.store.discard(tmp)
                    problems.append(
                        str(exc) if isinstance(exc, CheckpointError) else f"{where}: {_why(exc)}"
                    )
            event["peer_s"] = time.perf_counter() - t1
        return "; ".join(problems) or None

    def _reserve(
        self, owner: int, step: int, size: int, problems: list[str]
    ) -> tuple[Any, str | None]:
        """(a writable image of ``size`` bytes, its temporary file): the owner's next file
        mapped, or, when that fails (a full tmpfs), a reused buffer and None (the failure
        goes to ``problems``: this copy is not kept on this node)."""
        try:
            tmp, image = self.store.reserve(owner, size)
            return image, tmp
        except (OSError, CheckpointError) as exc:  # CheckpointError: private.py refused
            path = self.store.path(owner, step)
            problems.append(f"rank {self.rank}: writing {path}: {_why(exc)}")
            self._filled = self._filled or getattr(exc, "errno", None) in _FULL
        spare = self._spare.get(owner)
        if spare is None or spare.shape != (size,):
            import numpy as np

            spare = self._spare[owner] = np.empty(size, np.uint8)
        return spare, None

    def wait(self) -> float:
        """Block until the generation in flight (if any) is written; the seconds waited."""
        t0 = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        return time.perf_counter() - t0

    def take_events(self) -> list[dict[str, Any]]:
        """Finished generations' events (none while one is in flight)."""
        if self._thread is not None and self._thread.is_alive():
            return []
        events, self._events = self._events, []
        return events

    # -- restore --------------------------------------------------------------------------
    def restore(
        self, states: dict[str, Any], durable_step: int | Callable[[], int]
    ) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        """Load the newest complete memory generation at or after ``durable_step``; returns
        (the restore event, or None: use durable checkpoints; what was passed over).
        ``durable_step`` may be a function: rank 0 calls it (listing the durable store) on
        a thread while the copies are scanned and moved, and its answer rides in the
        verdicts; a generation older than it is then dropped, as if it had been known
        from the start (the newest complete generation is older than it, so is any other)."""
        t0 = time.perf_counter()
        self.wait()
        if self.off is not None:
            return None, [{"path": self.store.root, "step": 0, "reason": self.off}]
        listing = Background(durable_step if callable(durable_step) and self.rank == 0 else None)
        known = None if callable(durable_step) else int(durable_step)
        nodes = self.pairing.nodes
        mates = [r for r in range(self.world) if nodes[r] == self.node]
        # the ranks of a node share its directory: each verifies a part of it
        part = (mates.index(self.rank), len(mates))
        found, passed = self.store.scan(self.job, self.world, part, self.nonce)
        held = {o: {s: list(v) for s, v in steps.items()} for o, steps in found.items()}
        gathered = self.group.all_gather((held, passed))
        # what every node passed over, on every rank: rank 0's restore record holds it all
        passed = [{**p, "node": nodes[r]} for r in range(self.world) for p in gathered[r][1]]
        everyone: list[dict[int, dict[int, Any]]] = []
        for r in range(self.world):  # what a rank's node holds, any rank of it can read
            merged: dict[int, dict[int, Any]] = {}
            for m in (m for m in range(self.world) if nodes[m] == nodes[r]):
                for owner, steps in gathered[m][0].items():
                    merged.setdefault(owner, {}).update(steps)
            everyone.append(merged)
        # Copies were checked by header at the scan; a payload is checked once, by the rank
        # that loads it. A damaged one drops that copy (or, for any other doubt, the step)
        # and the ranks agree on the next plan.
        for _ in range(_ATTEMPTS):
            plan = choose(everyone, self.world, known or 0)
            if plan is None:
                break
            step, sources = plan
            src, nbytes = sources[self.rank]
            err, damaged, header, tree, buf = None, False, {}, None, None
            where = f"{self.store.path(self.rank, step)} (on {nodes[src]}, rank {src})"
            try:
                buf, header, tree = self._fetch(step, sources, where)
                if snap.has_shards(tree):  # FSDP2 / tensor parallel: on the live layout
                    tree = snap.place_shards(tree, S.dcp_state_dict(states))
                check_copy(header, tree, states, self.job, self.world, self.rank, step, self.nonce)
                if src == self.rank:  # now, while the ranks that receive are still busy
                    tree = owned(tree, states)
            except FAILURES as exc:  # noqa: BLE001 - any doubt: another plan, or durable
                err, damaged = f"rank {self.rank}: {exc}", isinstance(exc, Damaged)
            newest_durable = listing.result() if known is None else None
            sent, self._sent = self._sent, []  # what this rank's sends could not give
            verdicts = self.group.all_gather((err, src != self.rank, damaged, newest_durable, sent))
            if known is None:
                known = int(verdicts[0][3] or 0)
                if step < known:  # older than the newest durable commit: durable it is
                    plan = None
                    break
            errors = [e for e, _, _, _, _ in verdicts if e]
            if not errors:
                break
            holders = [p for *_, sent in verdicts for p in sent]  # why a copy came as zeros
            reason = "memory restore refused: " + "; ".join((holders + errors)[:4])
            passed.append({"path": self.store.root, "step": step, "reason": reason})
            for owner, (e, _, bad, _, _) in enumerate(verdicts):
                if not e:
                    continue
                src_node = nodes[sources[owner][0]]
                for r in range(self.world):  # that copy (damaged), or the step (any doubt)
                    if not bad or nodes[r] == src_node:
                        for o in [owner] if bad else list(everyone[r]):
                            everyone[r].get(o, {}).pop(step, None)
        else:
            plan = None
        if plan is None:
            newest = max((s for h in everyone for st in h.values() for s in st), default=0)
            newest = max([newest] + [p["step"] for p in passed])
            since = "" if known is None else f" at or after durable step {known}"
            why = (
                f"no memory generation{since} is complete and good for all {self.world} "
                f"ranks (newest copy seen: step {newest})"
            )
            passed = bounded(passed, self.store.root)
            if not newest:  # nothing in memory (a fresh job): nothing to report
                return None, passed
            return None, passed + [{"path": self.store.root, "step": newest, "reason": why}]
        from_peer = src != self.rank
        try:
            modules, _, _ = S.split_states(states)
            S.apply_dcp_state_dict(states, tree)
            if from_peer:
                give_back(buf, [v for k, v in tree.items() if k not in modules])
            S.apply_json_states(states, header["json_states"])
            S.set_rng_state(header["rng"])
        except FAILURES as exc:  # noqa: BLE001 - checked above; a surprise still falls back
            err = f"rank {self.rank}: loading failed: {_why(exc)}"
        failed = [e for e in self.group.all_gather(err) if e]
        if failed:
            self.touched = True  # the live states hold part of this snapshot
            reason = "memory restore failed while loading: " + "; ".join(failed[:4])
            passed = bounded(passed, self.store.root)
            return None, passed + [{"path": self.store.root, "step": step, "reason": reason}]
        self.last_step = step
        passed = bounded(passed, self.store.root)
        return {
            "type": "restore",
            "step": step,
            "tier": "peer-memory" if any(p for _, p, _, _, _ in verdicts) else "local-memory",
            "restore_s": time.perf_counter() - t0,
            "bytes_local": 0 if from_peer else nbytes,
            "bytes_peer": nbytes if from_peer else 0,
            "path": f"{self.pairing.nodes[src]}:{self.store.path(self.rank, step)}",
            "skipped": passed,
            "tokens_seen": int(header.get("tokens_seen", 0)),
            "changes": S.json_state_changes(states),
        }, passed

    def _fetch(self, step: int, sources: dict[int, tuple[int, int]], where: str) -> Any:
        """This rank's copy of ``step``, verified and decoded (buffer, header, tree): its node's
        copy, or the holder's; and serve the copies this rank holds for owners without one
        (its own copy is verified while they are sent). Files are mapped, not read: a tmpfs
        copy is loaded and sent from its pages in place. Raises ``Damaged`` for a copy
        that fails its checksum or does not decode."""
        import numpy as np

        sends = []
        for owner, (src, nbytes) in sorted(sources.items()):
            if src == self.rank and owner != self.rank:
                path = self.store.path(owner, step)
                try:
                    image = snap.map_file(path, readonly=True)
                except (OSError, CheckpointError) as exc:  # gone or replaced since the scan
                    self._sent.append(f"rank {self.rank}: {path}: {_why(exc)}; zeros sent")
                    image = np.zeros(nbytes, dtype=np.uint8)  # the owner's check fails
                sends.append((owner, image, nbytes))
        src, nbytes = sources[self.rank]
        recv = None if src == self.rank else (src, nbytes)
        local, refused = None, None
        if recv is None:
            try:  # after the transfers are posted, never before: the others wait for them
                local = snap.map_file(self.store.path(self.rank, step))
            except FileNotFoundError:
                pass  # vanished: fails the check below
            except (OSError, CheckpointError) as exc:
                refused = exc
        transfer = peers.Transfer(self.group.pg, sends, recv)
        self._sent += [f"rank {self.rank}: {p}" for p in transfer.problems]
        try:
            if refused is not None:  # another copy of this step may still do
                raise Damaged(str(refused))
            if recv is None:
                return local, *parse_copy(local, self.store.path(self.rank, step), where)
        finally:
            transfer.wait()  # the sends read their mappings until they are done
        got = transfer.received
        return got, *parse_copy(got, self.store.path(self.rank, step), where)

    def forget_after(self, step: int) -> None:
        """After a restore to ``step``: newer copies on this node are a future that will
        not happen."""
        if self._usable:
            with contextlib.suppress(OSError):
                self.store.drop_after(step)

    def close(self, remove: bool) -> None:
        """Wait for the generation in flight; ``remove``: the job ended with nothing in
        memory newer than its durable checkpoints, so this node's copies go."""
        self.wait()
        self.stager.release()
        self._spare.clear()
        if remove and self._usable:
            self.store.remove_all()
