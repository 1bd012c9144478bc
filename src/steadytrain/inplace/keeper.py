"""The keeper: the process torchrun (or srun) starts for a rank, which forks the training
process.

    torchrun --nproc-per-node 8 ... -m steadytrain.inplace.keeper train.py --my-args
    srun --ntasks-per-node 8 --kill-on-bad-exit=1 python -m steadytrain.inplace.keeper train.py

Why a process between torchrun and the training process (measured by
``bench/inplace_detect.py``): torchrun's agent restarts its whole local worker group when
one worker dies (``SimpleElasticAgent._invoke_run`` -> ``_restart_workers``: stop every
local worker, rendezvous again, start them all; each costs one of ``--max-restarts``), so a
survivor can only keep its process if the process torchrun watches does not die. The
keeper is that process. It imports torch, steadytrain and the modules the script imports
at its top level (read with ``ast``, never by running the script), then forks the training
process, which runs the script as ``__main__`` (``runpy.run_path``) with the arguments,
working directory and environment torchrun gave. When that process dies of a process
fault and ``policy.Policy`` allows, the keeper forks a replacement at once, already
imported; the replacement's ``Recovery.start()`` joins the survivors' new group. Otherwise
the keeper ends the way its child did (the same exit status, or the same signal), and
torchrun's whole restart is the fallback, as without a keeper.

In-place recovery needs a store that outlives any training process: torchrun's own
TCPStore, which workers share unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (then rank
0's training process hosts it and dies with it), or under ``srun`` without torchrun (one
task per rank) the store rank 0's keeper hosts (``slurm.py``: the ranks from ``SLURM_*``).
Without either the keeper warns once and runs the script with in-place recovery off.

What the child gets (``Recovery`` reads it): ``STEADYTRAIN_INPLACE`` ("1" on, "0" off),
``STEADYTRAIN_INPLACE_INCARNATION`` (0 for the first process, n for the n-th replacement),
``STEADYTRAIN_INPLACE_FD`` (a pipe to the keeper: one byte once the process completed a
step, which tells a passing fault from a repeating one). ``STEADYTRAIN_INPLACE_MAX`` (the
keeper's; default 3) bounds the in-place recoveries per rank per torchrun attempt.

What a fork must reset, as ``steadytrain.testing.forkserver`` does for its children: the
signal handlers (the keeper forwards SIGTERM/SIGINT/SIGHUP to its child), the global torch
and numpy generators (reseeded from the OS, as a fresh interpreter would be), and a death
signal so a SIGKILLed keeper takes its child with it. The hash seed is the keeper's, the
same for every process of this rank.
"""

from __future__ import annotations

import ast
import ctypes
import gc
import importlib
import logging
import os
import runpy
import signal
import sys
import threading
from collections.abc import Sequence

from steadytrain.inplace.contract import ENV_FD, ENV_INCARNATION, ENV_MAX, ENV_ON
from steadytrain.inplace.policy import Death, Policy
from steadytrain.inplace.slurm import host_store, leave_together, slurm_ranks

__all__ = ["imports_of", "main"]

log = logging.getLogger("steadytrain.inplace")

_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1


def imports_of(script: str) -> list[str]:
    """The absolute module names ``script`` imports at its top level (``import a.b``, ``from
    a.b import c``), in order, those in a top-level ``try:`` too (an optional module); what
    sits in functions or under ``if`` is not imported."""
    with open(script, "rb") as f:
        tree = ast.parse(f.read(), filename=script)
    names: list[str] = []
    body = [n for top in tree.body for n in (top.body if isinstance(top, ast.Try) else [top])]
    for node in body:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return list(dict.fromkeys(names))


def _preload(script: str) -> None:
    for name in ("torch", "torch.distributed", "steadytrain.inplace.recovery", *imports_of(script)):
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - the child imports it again and says why
            log.debug("keeper: could not preload %s: %s", name, e)


def _warm_up() -> None:
    """One optimizer step on a tiny DDP-free model: torch imports and initialises much of
    itself on first use (the optimizers' compile checks, autograd's engine), ~2-3 s here
    that every replacement would otherwise pay again. On one intra-op thread, so the keeper
    starts no thread pool that a fork would copy without its threads. Then every object so
    far is frozen out of the collector's scans (below)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
        for optim in (torch.optim.AdamW(model.parameters()), torch.optim.SGD(model.parameters())):
            model(torch.zeros(2, 8)).sum().backward()
            optim.step()
            optim.zero_grad()
    finally:
        torch.set_num_threads(threads)
    # What the imports and this step made lives as long as the keeper: moved out of the
    # collector's sight (gc.freeze, as Python's docs advise before a fork), so a forked
    # process's full collection scans only what it made itself. A survivor's regroup collects
    # the dropped DDP: 0.18 s over the ~380,000 objects of torch and the trainer's imports,
    # 0.012 s frozen (measured on the demo's process), on the path the replacement waits on.
    gc.collect()
    gc.freeze()


def foreign_threads() -> list[str]:
    """The names of the threads running beside this one: a module that started a thread as
    it was imported. A fork copies none of them, and a lock one of them held stays held in
    the child for good."""
    me = threading.get_ident()
    return [t.name for t in threading.enumerate() if t.ident != me]


def _store_shared() -> bool:
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def _become_child(
    script: str, args: Sequence[str], env: dict[str, str], keeper: int, hosted: object = None
) -> int:
    """In the forked child: run ``script`` as ``__main__``; its exit status. ``hosted``: the
    store rank 0's keeper hosts under srun, which the child must never destroy: its server
    thread is the keeper's, and the destructor's join of a thread the fork did not copy
    aborts the child as it exits (std::system_error, seen here). One reference more, never
    released, and Python's exit leaves it alone."""
    if hosted is not None:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(hosted))
    for sig in _FORWARDED:
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != keeper:  # the keeper died before the death signal was set
        return 1
    os.environ.update(env)
    if "torch" in sys.modules:  # a fresh interpreter's generators start from the OS
        sys.modules["torch"].seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException as e:  # noqa: BLE001 - reported as a fresh Python reports it:
        # through the script's hook (steadytrain's trainer hooks book a crash's reason there),
        # and an uncaught KeyboardInterrupt ends the process by SIGINT, as Py_RunMain does
        sys.excepthook(type(e), e, e.__traceback__)
        return -signal.SIGINT if isinstance(e, KeyboardInterrupt) else 1
    return 0


def _note_fallback(rank: str, why: str) -> None:
    """Leave the reason of this whole restart in torchrun's store, where the next attempt's
    rank 0 reads it into an ``inplace_recovery`` record (best effort, a few seconds at most:
    the restart must not wait for it)."""
    try:
        from steadytrain.inplace.regroup import store
        from steadytrain.run_inplace_step import note_fallback

        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        note_fallback(store(5.0), attempt, int(rank), why, None, keep_existing=True)
    except Exception as e:  # noqa: BLE001 - the reason is lost, never the restart
        log.warning("keeper: could not note the fallback in the store: %s", e)


def _finish_then_kill(sig: int) -> None:
    """End the training process by ``sig`` once it has done what an exit does."""
    import atexit

    threading._shutdown()  # type: ignore[attr-defined]  # as Py_FinalizeEx does
    atexit._run_exitfuncs()
    _end_like(-sig)


def _end_like(code: int) -> None:
    """End this process the way its child ended: torchrun sees the same failure."""
    sys.stdout.flush()
    sys.stderr.flush()
    if code < 0:
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # those two cannot be caught
            signal.signal(-code, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [-code])
        os.kill(os.getpid(), -code)
    os._exit(code if code >= 0 else 128 - code)


def main(argv: Sequence[str]) -> None:
    if not argv or argv[0].startswith("-"):
        raise SystemExit(
            "usage: torchrun ... -m steadytrain.inplace.keeper SCRIPT.py [ARGS...], or srun "
            "... python -m steadytrain.inplace.keeper SCRIPT.py [ARGS...] (the training "
            "script's path, then its arguments)"
        )
    script, args = os.path.abspath(argv[0]), list(argv[1:])
    if not os.path.isfile(script):
        raise SystemExit(f"steadytrain.inplace.keeper: no script at {script}")
    try:  # under srun without torchrun: torch's variables from Slurm's (slurm.py)
        slurm = slurm_ranks(os.environ)
    except ValueError as e:
        raise SystemExit(f"steadytrain.inplace.keeper: {e}") from None
    os.environ.update(slurm or {})  # the child's environment, and this keeper's store client
    rank = os.environ.get("RANK", "?")
    policy = Policy(int(os.environ.get(ENV_MAX, "3")))
    on = policy.max_recoveries > 0 and (_store_shared() or slurm is not None)
    if policy.max_recoveries > 0 and not on:
        print(
            f"steadytrain.inplace: rank {rank}: in-place recovery is off: it needs torchrun's "
            "shared store (unset TORCH_DISABLE_SHARE_RDZV_TCP_STORE) or srun's tasks (rank "
            "0's keeper hosts the store); a fault restarts the whole job, as without the keeper",
            file=sys.stderr,
            flush=True,
        )
    store = None  # rank 0's keeper under srun: the store that outlives its training process
    if on and slurm is not None:
        if rank == "0":
            store = host_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # env:// is the store's client
    sys.path[0] = os.path.dirname(script)  # as `python SCRIPT` has it, for the preload too
    _preload(script)
    _warm_up()
    if threads := foreign_threads():
        print(
            f"steadytrain.inplace: rank {rank}: the script's imports started threads in the "
            f"keeper ({', '.join(threads)}); each training process is forked without them. If "
            "one hangs at start, import that module inside the script's main() instead",
            file=sys.stderr,
            flush=True,
        )
    child = 0
    stopping = False

    def forward(sig: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True  # torchrun stops the group: no replacement after this
        if child:
            os.kill(child, sig)

    for sig in _FORWARDED:
        signal.signal(sig, forward)
    recovered = 0
    while True:
        read_end, write_end = os.pipe()
        env = {ENV_ON: "1" if on else "0", ENV_INCARNATION: str(recovered)}
        env[ENV_FD] = str(write_end)
        sys.stdout.flush()
        sys.stderr.flush()
        keeper = os.getpid()
        child = os.fork()
        if child == 0:
            os.close(read_end)
            code = _become_child(script, args, env, keeper, store)
            if code < 0:  # its end (threads, atexit, stdio), then the signal, as CPython does
                _finish_then_kill(-code)
            raise SystemExit(code)  # atexit, threads joined, stdio flushed, as a fresh Python
        os.close(write_end)
        _, status = os.waitpid(child, 0)
        code = os.waitstatus_to_exitcode(status)
        os.set_blocking(read_end, False)
        try:
            stepped = bool(os.read(read_end, 64))
        except BlockingIOError:  # a grandchild still holds the pipe open, with nothing sent
            stepped = False
        os.close(read_end)
        # The store outlives every rank's use of it (not when srun stops the step: then its
        # SIGKILL follows the SIGTERM, and rank 0's keeper must not wait for ranks that failed)
        if code == 0 and on and slurm is not None and not stopping:
            leave_together(store, int(os.environ["WORLD_SIZE"]))
        if code == 0 or stopping:
            _end_like(code)
        death = Death(code, stepped)
        why = policy.verdict(death, recovered) if on else "in-place recovery is off"
        if why is not None:
            print(
                f"steadytrain.inplace: rank {rank}: process {child} {death.describe()}; "
                f"whole restart: {why}",
                file=sys.stderr,
                flush=True,
            )
            if on:  # for the next attempt's ledger: which path, and why (Run writes it)
                _note_fallback(rank, f"process {death.describe()}: {why}")
            _end_like(code)
        recovered += 1
        print(
            f"steadytrain.inplace: rank {rank}: process {child} {death.describe()}; "
            f"replacing it in place ({recovered} of {policy.max_recoveries})",
            file=sys.stderr,
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1:])
