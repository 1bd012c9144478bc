"""``Run``: the one public entry a training loop holds -- yours, or ``steadytrain train``'s.

    with Run("runs/r1", states, total_steps=N, checkpoint={"every_steps": 100}) as run:
        step = run.start_step                     # restored (0 on a fresh start)
        while step < N:
            with run.data_wait():                 # time blocked on data
                batch = next(loader)
            ...                                   # forward, backward, optimizer
            step += 1
            run.step_done(step, tokens=global_batch * seq_len, loss=loss.detach())

What it owns, and why each is here rather than in the loop (issue 27):

- the ``GoodputMeter`` (RUN_DIR/ledger.jsonl, every rank's file) and the ``Checkpointer``
  (built from ``checkpoint=``, or yours, passed in);
- start-up and restart accounting: the start-up clock starts at the process's birth
  (``run_birth.py``), the restore is timed, and the restore event is held until
  ``job_start`` opened the attempt -- recorded before it, its time would end the previous
  attempt and book the whole restart gap as 0 and the start-up as "other"; the start-up is
  recorded in phases (imports, the user's build, group, Run's set-up: ``run_phases.py``);
- the hang watchdog: liveness is ``step_done``; a rank without progress past its deadline
  dumps stacks, is recorded as a ``hang`` and exits 124 so torchrun restarts the job;
- evaluation accounting: the time inside ``phase("eval")`` is the next step record's
  ``eval_s`` (the ``eval`` bucket); the data wait and compute are timed on ``clock()``,
  which stops inside it, so an evaluation is never booked as either (issue 42);
- crash recording: an exception inside the ``with`` (a gloo "Connection reset by peer"
  after a peer died included) or SIGTERM ends the attempt with ``job_end`` reason
  ``error: ...`` / ``signal: SIGTERM``, which the report lists as a crash, never the clean
  ``interpreter_exit`` of the meter's exit hook; a SIGTERM the loop cannot see (inside a C++
  call: a collective behind a peer that cannot leave) is recorded the same way by a watcher
  thread, which then exits 143 (``run_stuck.py``, ``monitor.sigterm_exit_s``);
- the rendezvous-store check (``run_support.agent_store_warning``: a warning, see there);
- one live job per run directory: rank 0 takes the run lease (``run_lease.py``) before any
  restore or record, and a start while another live job holds it raises
  ``RunDirInUseError`` on every rank, naming the holder (host, pid, lease file) and the fix;
- step numbers that lose no work (``run_support.check_step``): an integer, above the
  previous step (the first one above ``start_step``), below 2**53; a call on a closed Run
  is a clear error;
- the final save: on a clean exit the last step is committed even when it is not a
  multiple of ``every_steps``;
- in-place recovery, opt-in (``recovery={"inplace": True}``, run_inplace.py): under the
  keeper, Run forms the group, ``run.wrap`` rebuilds DDP and ``with run.recoverable(step)``
  turns a lost peer into a rollback and a regroup instead of a whole restart (FSDP2: the
  loop calls ``run_inplace.form_group`` before ``fully_shard``, and every rank restores its
  shard from the memory tier); the decision and its reason are ``run_inplace.decide``'s,
  the records ``run_inplace_step.py``'s;
- the closing order: the final save and the in-flight save finish (the meter records
  them), the watchdog stops, the meter writes ``job_end`` last; the process group is the
  caller's unless Run created it.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from steadytrain.checkpoint.checkpointer import Checkpointer
from steadytrain.checkpoint.config import CheckpointerConfig
from steadytrain.inplace import regroup
from steadytrain.inplace.contract import ENV_INCARNATION
from steadytrain.monitor.extras import loader_fields
from steadytrain.monitor.meter import GoodputMeter
from steadytrain.monitor.meter_config import MeterConfig
from steadytrain.monitor.watchdog import HangWatchdog, backend_timeout_s, recover_hang_records
from steadytrain.run_birth import process_start
from steadytrain.run_final_save import final_save_failed
from steadytrain.run_identity import establish as establish_identity
from steadytrain.run_inplace import InPlace, RecoveryConfig, decide, recovery_config
from steadytrain.run_inplace_step import InPlaceLedger, RecoverableStep
from steadytrain.run_lease import lease_settings, take_run_lease
from steadytrain.run_phases import StartupClock
from steadytrain.run_stuck import StuckExit
from steadytrain.run_support import (
    EVAL_PHASE,
    DataWait,
    EvalClock,
    EvalPhase,
    SignalGuard,
    Terminated,
    agent_store_warning,
    check_step,
    checkpointer_config,
    crash_reason,
    meter_config,
    not_open,
    say,
)

# The process's birth (exact on Linux, from /proc; elsewhere this import's time).
PROCESS_START = process_start()
# When this module was imported: the end of the start-up's "imports" phase (run_phases.py).
IMPORTED_AT = time.time()

__all__ = ["Run"]


class Run:
    """A training run's attempt, from restore to the last commit. See the module docstring.

    ``states``: what a checkpoint holds (objects with ``state_dict``/``load_state_dict``:
    model, optimizer, scheduler, ``TokenLoader``, your counters). ``rank``/``world_size``:
    default from torchrun's ``RANK``/``WORLD_SIZE`` (else 0 and 1). ``checkpoint``: a
    ``CheckpointerConfig``, a dict of its keys (None: the defaults, which save by neither
    steps nor time: only the final save), a ready checkpointer (anything with
    ``restore_latest``/``maybe_save``/``save``/``wait``/``close``/``last_event``; a
    ``restore_latest`` that returns None says the restore point is unknown), or
    ``False`` for none (a trainer that checkpoints itself; pass ``restored_step``).
    ``checkpoint_dir``: default ``RUN_DIR/checkpoints``. ``monitor``: a ``MeterConfig`` or
    a dict of its keys (``{"watchdog": {"floor_s": 30}}``). ``config``: what the ledger and
    MLflow record as the run's parameters (redact secrets first: ``steadytrain.redact``).
    ``device``: "cpu"/"cuda", so alerts advise for the hardware. ``backend_timeout_s``: the
    process group's collective timeout, if you set one (the watchdog warns when its
    deadlines reach it). ``say``: where progress lines go (stderr by default).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        states: dict[str, Any],
        *,
        rank: int | None = None,
        world_size: int | None = None,
        total_steps: int | None = None,
        checkpoint: Any = None,
        checkpoint_dir: str | None = None,
        monitor: MeterConfig | dict[str, Any] | None = None,
        config: dict[str, Any] | None = None,
        device: str | None = None,
        backend_timeout_s: float | None = None,
        restored_step: int = 0,
        recovery: RecoveryConfig | dict[str, Any] | None = None,
        say: Callable[[str], None] = say,
    ) -> None:
        self.run_dir = os.fspath(run_dir)
        self.states = states
        self.rank = int(os.environ.get("RANK", 0)) if rank is None else int(rank)
        self.world_size = (
            int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else int(world_size)
        )
        self.total_steps = total_steps
        self.monitor = meter_config(monitor)
        self._checkpoint = checkpoint
        self.checkpoint_dir = checkpoint_dir or os.path.join(self.run_dir, "checkpoints")
        self._config, self._device = config, device
        self._backend_timeout_s = backend_timeout_s
        self._restored_step = int(restored_step)
        self.recovery = recovery_config(recovery)
        self._inplace: InPlace | None = None  # in-place recovery, when decide() chose it
        self._inplace_ledger: InPlaceLedger | None = None
        self.inplace_why = ""  # why in-place recovery is on or off (run_inplace.decide)
        self._say = say
        self.meter: GoodputMeter | None = None
        self.checkpointer: Any = None
        self.watchdog: HangWatchdog | None = None
        self.start_step = 0  # the step restored at entry (0: a fresh start)
        self.step = 0  # the last step reported by step_done
        self.tokens_seen = 0  # tokens of all steps so far, restored ones included
        self.attempt = 0  # this attempt's number in the ledger (rank 0's count)
        self.attempt_id = 0.0  # one id shared by the ranks of this attempt
        self.nonce = ""  # the run's identity (run_identity.py), the same on every rank
        self._signals = SignalGuard()
        # SIGTERM while the loop is stuck in a C++ call: record the end, exit (run_stuck.py)
        self._stuck = StuckExit(
            self.monitor.sigterm_exit_s,
            self._abandon,
            busy=self._saving,
            reacted=lambda: self._signals.pending is not None,  # its handler ran: not stuck
            patience=lambda: 2.0 * self._longest_step_s,  # a long step is not a stuck one
        )
        self._longest_step_s = 0.0  # the longest interval between two step_done calls
        self._last_step_t: float | None = None
        self._lease: Any = None  # rank 0's run lease (run_lease.py)
        self._state = "new"  # "open" between entry and close, then "closed"
        self._made_group = False
        self._wait_s = 0.0
        self._save_block_s = 0.0  # blocked by save() since the last step_done
        # Intervals are timed on a clock that stops inside eval phases (run_support.EvalClock):
        # an evaluation is the step's eval_s, never its data wait, compute or save.
        self._eval = EvalClock()
        self._eval_seen = 0.0  # evaluation seconds booked by the steps so far
        self._mark = self._eval.outside()

    # -- entry -----------------------------------------------------------------------------
    def __enter__(self) -> Run:
        if self._state != "new":
            raise RuntimeError("a Run is entered once: open a new Run for another attempt")
        self._state = "open"
        try:
            self._start()
        except BaseException as exc:
            self._close(exc)
            raise
        return self

    def _start(self) -> None:
        born, imported = PROCESS_START, IMPORTED_AT
        if int(os.environ.get(ENV_INCARNATION, "0")) > 0:
            # A replacement the keeper forked (run_inplace.py): its birth is the fork, and
            # its imports were done before it (both times above are the keeper's).
            born = imported = process_start()
        clock = StartupClock(born, imported)  # the start-up's phases
        os.makedirs(self.run_dir, exist_ok=True)
        self._signals.install()
        if self._signals.installed:
            self._stuck.start()
        given = self._checkpoint
        inplace, self.inplace_why = decide(
            self.recovery,
            os.environ,
            world_size=self.world_size,
            # a group that form_group formed in place is Run's own (a model sharded first)
            group_exists=dist.is_initialized()
            and regroup.formed(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) is None,
            rebuildable_checkpoint=given is None
            or isinstance(given, (bool, dict, CheckpointerConfig)),
        )
        if self.recovery.inplace and not inplace and self.rank == 0:
            self._say(f"in-place recovery is off: {self.inplace_why}; a fault restarts the job")
        # In place, the shared store is what a regroup needs (pytorch#135712 is avoided by
        # the per-attempt prefix): no warning then.
        warning = None if inplace else agent_store_warning()
        if warning and self.rank == 0:
            self._say(warning)
        replaced_step: int | None = None  # this process replaces a lost one: its step
        if inplace:
            clock.group_begin()  # a replacement also rejoins and restores here (run_inplace)
            self._inplace = InPlace(self.recovery, self.states, self)
            first = self._inplace.start()
            clock.group_end()
            self._made_group = True
            replaced_step = first if self._inplace.replaced else None
        elif not dist.is_initialized() and "MASTER_ADDR" in os.environ and self.world_size > 1:
            clock.group_begin()
            dist.init_process_group()  # torchrun's env; destroyed at exit (ours, not yours)
            clock.group_end()
            self._made_group = True
        # Before any rank writes a record or restores: another live job may hold RUN_DIR.
        job, lease_timeout_s = lease_settings(self._checkpoint)
        self._lease = take_run_lease(
            self.run_dir,
            self.rank,
            job=job,
            timeout_s=lease_timeout_s,
            say=self._say,
            share=replaced_step is None,  # a replacement's survivors are past this collective
        )
        self.meter = self._make_meter()
        held: list[dict[str, Any]] = []  # the restore event waits for job_start (see above)
        if self._inplace is not None:  # rebuilt after each regroup, before the loop's DDP
            ckpt = self._inplace.wrap_checkpointer(lambda: self._make_checkpointer(held.append))
            if self._inplace.sharded and getattr(ckpt, "memory", None) is None and self.rank == 0:
                self._say(
                    "in-place recovery: FSDP2's shards come back from the memory tier, which "
                    "is off (checkpoint.memory.every_steps): a fault restarts the job"
                )
        else:
            ckpt = self._make_checkpointer(held.append)
        # One id per attempt, shared by all ranks (each agent counts its own restarts),
        # rank 0's attempt number (from the ledger) for every rank's own file, and the
        # run's identity (run_identity.py), which the restore needs: nothing another run
        # wrote is restored.
        ids: list[Any] = [time.time(), self.meter.attempt, None]
        if self.rank == 0:
            adopt = getattr(ckpt, "newest_run_nonce", None)
            ids[2] = establish_identity(self.run_dir, adopt).nonce
        if replaced_step is not None:  # the survivors are past their broadcast: the store
            self._inplace_ledger = InPlaceLedger(self._inplace)
            ids = self._inplace_ledger.share_ids(self.rank, ids)
        elif dist.is_initialized() and dist.get_world_size() > 1:
            clock.group_begin()  # the first collective: it waits for the slowest rank
            dist.broadcast_object_list(ids, src=0)
            clock.group_end()
        self.attempt_id, self.attempt, self.nonce = float(ids[0]), int(ids[1]), str(ids[2])
        if ckpt is not None and hasattr(ckpt, "run_nonce"):
            ckpt.run_nonce = self.nonce
        t_restore = time.perf_counter()
        if replaced_step is not None and self._inplace.sharded:  # its shard, from memory
            step, restore_s = self._inplace.restore_replaced(), self._inplace_ledger.restore_s()
        elif replaced_step is not None:  # restored from a survivor and its own snapshot
            step, restore_s = replaced_step, self._inplace_ledger.restore_s()
        else:
            step = ckpt.restore_latest(self.states) if ckpt is not None else self._restored_step
            restore_s = time.perf_counter() - t_restore if ckpt is not None else 0.0
        unknown = step is None
        if unknown:
            # The restore point is not known (a trainer that failed before it restored): the
            # ledger's own position, so this attempt charges nothing as redone; the attempt
            # that does restore charges the rollback.
            step = self.meter.position
        self.start_step = self.step = int(step)
        self.tokens_seen = int(getattr(ckpt, "tokens_seen", 0) or 0)
        startup_s = max(0.0, time.time() - born - restore_s)
        self.meter.job_start(
            attempt=self.attempt,
            restored_step=self.start_step,
            startup_s=startup_s,
            restore_s=restore_s,
            startup_phases=clock.phases(startup_s),
            born_t=born,
            config=self._config,
            device=self._device,
            run_nonce=self.nonce,
            restored_from=next((e for e in held if e.get("type") == "restore"), None),
            restore_unknown=unknown,
        )
        for event in held:
            self.meter.event(event)
        if ckpt is not None:
            ckpt.on_event = self.meter.event
            if hasattr(ckpt, "before_commit"):
                # A committed step is a recorded step: COMMIT waits for rank 0's ledger.
                ckpt.before_commit = self.meter.record_through
        if self._inplace is not None:
            self._inplace_ledger = self._inplace_ledger or InPlaceLedger(self._inplace)
            self._inplace_ledger.started(self, replaced=replaced_step is not None)
        self.meter.flush()  # the attempt's start is on disk even if it dies in step 1
        if self.rank == 0:
            # An earlier rank 0 was stuck: its verdicts, this run's own (the nonce) only.
            recover_hang_records(self.run_dir, self.meter, nonce=self.nonce or None)
        timeout = self._backend_timeout_s
        if timeout is None and dist.is_initialized():
            timeout = backend_timeout_s(dist.get_backend())
        self.watchdog = HangWatchdog(
            self.run_dir,
            self.rank,
            self.world_size,
            attempt=self.attempt,
            meter=self.meter,
            config=self.monitor.watchdog,
            backend_timeout_s=timeout,
            nonce=self.nonce,  # its reaper acts only on decisions that carry it
        )
        self._mark = self._eval.outside()

    def _make_meter(self) -> GoodputMeter:
        return GoodputMeter(
            self.run_dir,
            rank=self.rank,
            world_size=self.world_size,
            total_steps=self.total_steps,
            config=self.monitor,
        )

    def _reopen_after_regroup(self, step: int) -> None:
        """After an in-place regroup rolled back to ``step`` (run_inplace_step.py): the next
        attempt in the ledger, the rebuilt checkpointer wired to it, the step counters."""
        info = self._inplace.recovery.last_regroup or {}
        phases = dict(info.get("phases", {}))
        t0 = time.perf_counter()
        self.meter = self._make_meter()
        ids = self._inplace_ledger.next_ids(self.rank)
        self.attempt_id, self.attempt = float(ids[0]), int(ids[1])
        ckpt = self.checkpointer
        if ckpt is not None:
            if hasattr(ckpt, "run_nonce"):
                ckpt.run_nonce = self.nonce
            ckpt.on_event = self.meter.event
            if hasattr(ckpt, "before_commit"):
                ckpt.before_commit = self.meter.record_through
        restore_s = phases.pop("restore_s", 0.0)
        setup_s = phases.pop("rebuild_s", 0.0) + time.perf_counter() - t0
        group_s = phases.pop("regroup_s", 0.0)
        self.meter.job_start(
            attempt=self.attempt,
            restored_step=step,
            startup_s=group_s + setup_s,
            restore_s=restore_s,
            startup_phases={
                "imports_s": 0.0,
                "build_s": 0.0,
                "group_s": group_s,
                "setup_s": setup_s,
            },
            config=self._config,
            device=self._device,
            run_nonce=self.nonce,
        )
        self.meter.flush()
        self.start_step = self.step = int(step)
        self._last_step_t = None
        self._wait_s = self._save_block_s = 0.0
        self._mark = self._eval.outside()

    def _saving(self) -> bool:
        return bool(getattr(self.checkpointer, "saving", False))

    def _abandon(self, signum: int) -> None:
        """The end of a rank that a signal found stuck in a C++ call (run_stuck.py: on its
        watcher thread, the process exits right after): the crash recorded as the ordered
        close would record it, the run lease given back."""
        self._say(
            f"rank {self.rank}: {crash_reason(None, signum)} while the loop was inside a "
            "C++ call (a collective whose peer stopped?): recorded, exiting now"
        )
        self._state = "closed"
        if self.meter is not None:
            self.meter.close(crash_reason(None, signum))
        if self._lease is not None:
            self._lease.release()
            self._lease = None

    def _make_checkpointer(self, on_event: Callable[[dict[str, Any]], None]) -> Any:
        given = self._checkpoint
        if given is False:
            return None
        if given is None or isinstance(given, (dict, CheckpointerConfig)):
            cfg = checkpointer_config(given)
            self.checkpointer = Checkpointer(self.checkpoint_dir, on_event=on_event, config=cfg)
        else:  # a ready checkpointer: Run only rewires its events
            self.checkpointer = given
            given.on_event = on_event
        return self.checkpointer

    # -- the loop's calls ------------------------------------------------------------------
    def wrap(self, factory: Callable[[], Any]) -> Any:
        """``ddp = run.wrap(lambda: DistributedDataParallel(model))``: the object built over
        the process group, built again after each in-place regroup (hold no other reference
        to it). Without in-place recovery: ``factory()`` itself."""
        self._check_open("wrap")
        return factory() if self._inplace is None else self._inplace.recovery.wrap(factory)

    def recoverable(self, step: int) -> RecoverableStep:
        """``with run.recoverable(step) as s: ...`` around one training step (its forward,
        backward, update and ``step_done``), then ``step = s.next``. ``step``: the steps done
        so far (``run.step``). With in-place recovery on (``recovery.inplace`` under the
        keeper), a peer lost inside the block is recovered in place: the block ends early,
        the states roll back and ``s.next`` is the step to redo from (``s.recovered``).
        Otherwise ``s.next`` is ``step + 1`` and every error goes through."""
        self._check_open("recoverable")
        return RecoverableStep(self, step)

    def data_wait(self) -> DataWait:
        """``with run.data_wait(): batch = next(loader)`` -- counted as this step's data
        wait (or pass ``data_wait_s=`` to ``step_done``)."""
        self._check_open("data_wait")
        return DataWait(self._add_wait, self._eval.outside)

    def _add_wait(self, seconds: float) -> None:
        self._wait_s += seconds

    def step_done(
        self,
        step: int,
        *,
        tokens: int = 0,
        loss: Any = None,
        data_wait_s: float | None = None,
        compute_s: float | None = None,
        loader: Any = None,
        tokens_seen: int | None = None,
        **extra: Any,
    ) -> float:
        """Step ``step`` is finished (its optimizer update done), on every rank: save if due
        (under the watchdog's checkpoint deadline), record the step, beat the watchdog.
        ``tokens``: the whole global step's tokens (all ranks). ``loss``: a tensor is fine
        (converted in the meter's thread). ``data_wait_s``: else what ``data_wait()``
        timed. ``compute_s``: else the time since the previous ``step_done`` less the data
        wait and the evaluation (time an own ``data_wait_s``/``compute_s`` across an
        evaluation on ``clock()``). The seconds inside ``phase("eval")`` since the previous
        ``step_done`` are the record's ``eval_s``. ``loader``: its ``metrics()`` go into the
        step record (names the meter owns prefixed). ``tokens_seen``: the run's tokens so
        far, if you count them (else Run adds up ``tokens``; both go into the checkpoint's
        COMMIT). ``extra``: more fields for the step record. Returns the seconds the save
        blocked the loop.

        ``step``: an integer above the previous step (the first above ``start_step``) and
        below 2**53, else ``TypeError``/``ValueError`` here, before anything is saved or
        recorded (``run_support.check_step``)."""
        self._check_open("step_done")
        step = check_step(step, self.step, self.start_step)
        t = time.monotonic()
        if self._last_step_t is not None:
            self._longest_step_s = max(self._longest_step_s, t - self._last_step_t)
        self._last_step_t = t
        now, evaluated = self._eval.read()
        eval_s, self._eval_seen = max(0.0, evaluated - self._eval_seen), evaluated
        wait = self._wait_s if data_wait_s is None else float(data_wait_s)
        self._wait_s = 0.0
        if compute_s is None:
            compute_s = max(0.0, now - self._mark - wait)
        self.tokens_seen = self.tokens_seen + int(tokens) if tokens_seen is None else tokens_seen
        block, self._save_block_s = self._save_block_s, 0.0  # save()s made for this step
        if self.checkpointer is not None:
            with self.watchdog.phase("checkpoint"):  # a blocking save has its own deadline
                block += self.checkpointer.maybe_save(
                    step, self.states, tokens_seen=self.tokens_seen
                )
        if loader is not None and hasattr(loader, "metrics"):
            extra = {**loader_fields(loader.metrics()), **extra}
        self.meter.step(
            step,
            tokens=tokens,
            data_wait_s=wait,
            compute_s=compute_s,
            checkpoint_block_s=block,
            loss=loss,
            eval_s=eval_s,
            **extra,
        )
        self.watchdog.beat(step)  # liveness is loop progress, on every rank
        self.step = step
        if self._inplace_ledger is not None:  # a recovery's record, once its redo is done
            self._inplace_ledger.on_step(self, step)
        self._mark = self._eval.outside()
        return block

    def save(self, step: int, *, tokens_seen: int | None = None) -> float:
        """Save ``step`` now, whatever the checkpointer's interval says: a trainer's own
        decision (Lightning's ``ModelCheckpoint``, HF's ``save_strategy``) carried out by the
        checkpointer, under the watchdog's checkpoint phase. Call it on every rank, after the
        step's optimizer update and before its ``step_done``: the seconds it blocked the loop
        go into that step's record (``checkpoint_block_s``). ``tokens_seen``: the run's tokens
        through ``step`` (default: through the last ``step_done``). Returns the seconds."""
        if self.checkpointer is None:
            return 0.0
        tokens = self.tokens_seen if tokens_seen is None else int(tokens_seen)
        t0 = time.perf_counter()
        with self.watchdog.phase("checkpoint"):
            self.checkpointer.save(step, self.states, tokens_seen=tokens)
        block = time.perf_counter() - t0
        self._save_block_s += block
        return block

    @property
    def pending_block_s(self) -> float:
        """Seconds ``save()`` blocked since the last ``step_done`` (they go into the next)."""
        return self._save_block_s

    def phase(self, name: str) -> Any:
        """A legitimately long part of the loop under its own watchdog deadline, for every
        rank of the job while this rank is inside it: ``with run.phase("eval"): ...``
        (``monitor.watchdog.phases.eval_s``; any identifier, default ``checkpoint_s``).
        Phases nest; leaving one is progress. Call it on the ranks that do the work.

        ``"eval"`` is also what the goodput ledger books as evaluation: its seconds are the
        next step record's ``eval_s`` (the ``eval`` bucket), never data wait, compute or
        checkpoint time."""
        self._check_open("phase")
        phase = self.watchdog.phase(name)
        return EvalPhase(phase, self._eval) if name == EVAL_PHASE else phase

    def clock(self) -> float:
        """Seconds on a clock that stops inside ``phase("eval")`` (``time.perf_counter()``
        less the evaluation so far): an interval timed on it holds no evaluation. For a loop
        that passes its own ``data_wait_s``/``compute_s`` timed across an evaluation, as the
        trainer callbacks do."""
        return self._eval.outside()

    def _check_open(self, call: str) -> None:
        if self._state != "open" or self.meter is None:
            raise not_open(call, self._state)

    # -- exit ------------------------------------------------------------------------------
    def __exit__(self, exc_type: Any, exc: BaseException | None, _tb: Any) -> None:
        self._close(exc)

    def _close(self, exc: BaseException | None) -> None:
        """The closing order (module docstring). Never swallows ``exc``; an error while
        closing after a clean loop is recorded as a crash and raised."""
        self._stuck.closing()  # the ordered close: the SIGTERM watcher stands down
        self._signals.hold()  # a SIGTERM now is remembered, not allowed to cut this short
        self._state = "closed"
        error = exc
        closing, block = time.monotonic(), 0.0  # the final save, the wait for the one in flight
        try:
            if error is None:
                try:
                    self._final_save()
                except BaseException as e:  # a dead peer in the final save: a crash
                    error = e
            if self.checkpointer is not None:
                phase = self.watchdog.phase("checkpoint") if self.watchdog else None
                with phase or contextlib.nullcontext():
                    self.checkpointer.close()  # waits for the in-flight save; meter records it
                block = time.monotonic() - closing
        finally:
            if self.watchdog is not None:
                self.watchdog.close()
            if self._inplace_ledger is not None:
                self._inplace_ledger.close(self)
            if self.meter is not None:
                # an evaluation after the last step (a final one, or one a crash cut short)
                tail = max(0.0, self._eval.read()[1] - self._eval_seen)
                # The closing wait is checkpoint time no step record carries (not "other")
                reason = crash_reason(error, self._signals.pending)
                self.meter.close(reason, eval_s=tail, checkpoint_block_s=block)
            if self._lease is not None:  # after job_end: the next job may start now
                self._lease.release()
                self._lease = None
            if self._inplace is not None:  # the wrapped objects first, then the groups
                self._inplace.close()
            elif self._made_group and dist.is_initialized():
                dist.destroy_process_group()
            self._stuck.stop()
            self._signals.restore()
        if error is not None and error is not exc:
            raise error
        if exc is None and self._signals.pending is not None:
            raise Terminated(self._signals.pending)

    def finish(self) -> None:
        """Commit the last step now (the clean exit does it otherwise), e.g. before writing
        something that must come after the final checkpoint. Call it on every rank."""
        self._check_open("finish")
        self._final_save()

    def _final_save(self) -> None:
        """Commit the last step unless the newest save (or the restore) already holds it."""
        ckpt = self.checkpointer
        if ckpt is None:
            return
        with self.watchdog.phase("checkpoint"):
            ckpt.wait()
            last = ckpt.last_event or {}
            # held durably: a save of this step that committed, or a restore of it from
            # durable storage (one from the memory tier is not on durable storage yet)
            held = last.get("step") == self.step and last.get("ok", True)
            if not held or last.get("tier", "durable") != "durable":
                ckpt.save(self.step, self.states, tokens_seen=self.tokens_seen)
                ckpt.wait()
                final_save_failed(ckpt, self.step)
