"""Schedule-aware prefetch and eviction for a ``ShardCache``.

The data order is a pure function of the run settings (DESIGN invariant 1), so the shards a
node will read at every future step are known. A *schedule* is a callable
``schedule(a, b) -> [(step, shard), ...]`` giving, in step order, the shards the steps
``[a, b)`` read on this node (``Sampler.shards_for_steps`` has exactly this shape).

Policy:

* **Prefetch**: background threads fetch the shards of the next ``horizon_steps`` steps,
  earliest deadline first, ``workers`` at a time.
* **Eviction** (only with ``budget_bytes``): to make room, evict the cached shard whose next
  use is furthest in the future (Belady's rule, exact here because the future is known).
  A shard needed within the horizon is never evicted; if only such shards are cached the
  prefetcher waits instead of going over budget. A budget that holds the whole dataset
  therefore never evicts anything.
* Demand reads (``TokenDataset`` calling ``cache.local_path``) are never refused: a shard the
  prefetcher has not reached yet is fetched on the spot and counted as a miss.

``ahead_steps`` (also published as ``cache.prefetch_ahead_steps``) is how many steps from the
current one are fully cached: the slack the run has before it would wait on storage.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from steadytrain.errors import ConfigError
from steadytrain.storage.cache import ShardCache

__all__ = ["Prefetcher", "Schedule", "first_uses", "next_uses"]

log = logging.getLogger(__name__)

Schedule = Callable[[int, int], list[tuple[int, int]]]


def first_uses(pairs: list[tuple[int, int]]) -> dict[int, int]:
    """shard -> first step it is used at, from ordered (step, shard) pairs."""
    out: dict[int, int] = {}
    for step, shard in pairs:
        if shard not in out or step < out[shard]:
            out[shard] = step
    return out


def next_uses(
    schedule: Schedule, shards: set[int], start: int, *, window: int, limit: int
) -> dict[int, float]:
    """Next step at or after ``start`` each shard is used (inf if not within ``limit`` steps)."""
    found: dict[int, float] = {}
    a = start
    while len(found) < len(shards) and a < start + limit:
        for step, shard in schedule(a, a + window):
            if shard in shards and shard not in found:
                found[shard] = step
        a += window
    return {s: found.get(s, float("inf")) for s in shards}


class Prefetcher:
    """Background fetching of the next ``horizon_steps`` steps' shards into ``cache``.

    Call ``advance(step)`` when the training loop starts a step; ``close()`` at the end
    (also a context manager). ``total_steps`` bounds the schedule (None: unbounded).
    """

    def __init__(
        self,
        cache: ShardCache,
        schedule: Schedule,
        *,
        horizon_steps: int = 64,
        budget_bytes: int | None = None,
        workers: int = 2,
        start_step: int = 0,
        total_steps: int | None = None,
        lookahead_limit_steps: int | None = None,
    ) -> None:
        if horizon_steps < 1 or workers < 1:
            raise ConfigError(
                f"horizon_steps ({horizon_steps}) and workers ({workers}) must be >= 1"
            )
        if budget_bytes is not None and budget_bytes <= 0:
            raise ConfigError(f"budget_bytes must be positive, got {budget_bytes}")
        self.cache = cache
        self.schedule = schedule
        self.horizon = horizon_steps
        self.budget = budget_bytes
        self.total_steps = total_steps
        self.lookahead_limit = lookahead_limit_steps or 16 * horizon_steps
        self._step = start_step
        # The training thread only ever sets ``_step`` and ``_wake``: it never waits for the
        # lock the fetch threads plan under (planning calls the sampler and ``stat``).
        self._cond = threading.Condition()
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._inflight: set[int] = set()
        self._cached: set[int] = set()  # shards known to be published (refreshed per plan)
        self._plan: list[int] = []  # shards of the horizon, earliest first use first
        self._plan_uses: dict[int, int] = {}
        self._plan_step, self._plan_end = -1, start_step
        # Re-plan every horizon/8 steps, not every step: planning calls the sampler and
        # stat()s files, and the fetch threads share the GIL with the training thread.
        self._replan_every = max(1, horizon_steps // 8)
        self._stop = False
        self.errors = 0
        self.last_error: BaseException | None = None
        self.evicted: list[tuple[int, int]] = []  # (step at eviction, shard)
        self._threads = [
            threading.Thread(target=self._run, name=f"steady-prefetch-{i}", daemon=True)
            for i in range(workers)
        ]
        for t in self._threads:
            t.start()

    @classmethod
    def for_loader(
        cls, loader: Any, *, ranks: list[int] | None = None, **kwargs: Any
    ) -> Prefetcher | None:
        """A prefetcher driven by a ``TokenLoader``: its schedule, its position, its steps.

        ``ranks``: the ranks sharing this node's cache (None: every rank of the job). The
        loader's ``on_step`` hook is chained so the horizon slides by itself. Returns None
        when the loader's dataset is not read through a ``ShardCache`` (a local dataset).
        """
        cache = getattr(loader.datasets[0], "cache", None)
        if cache is None:
            return None
        world = loader.world_size

        def schedule(a: int, b: int) -> list[tuple[int, int]]:
            return loader.shards_for_steps(a, b, ranks=ranks, world_size=world)

        pf = cls(cache, schedule, start_step=loader.step, **kwargs)
        previous = loader.on_step

        def on_step(step: int) -> None:
            pf.advance(step)
            if previous is not None:
                previous(step)

        loader.on_step = on_step
        return pf

    # -- the training loop's side ------------------------------------------------------
    def advance(self, step: int) -> None:
        """The run is now at ``step``: slide the horizon and wake the fetchers.

        Runs on the training thread, so it only records the step: planning, ``stat`` calls
        and the ``ahead_steps`` gauge are the fetch threads' work."""
        self._step = step
        if not 0 <= step - self._plan_step < self._replan_every:
            self._wake.set()

    def ahead_steps(self) -> int:
        """Steps from the current one whose shards are all cached (capped at the horizon)."""
        with self._cond:
            self._refresh_plan()
            uses, step, end = dict(self._plan_uses), self._step, self._plan_end
            missing = [u for s, u in uses.items() if s not in self._cached]
        return max(0, (min(missing) if missing else end) - step)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until the whole horizon is cached (tests, staging). True if it is."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._stop or (self._refresh_plan() or self._plan_done()), timeout
            )

    def close(self) -> None:
        self._stopped.set()
        self._wake.set()
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        for t in self._threads:
            t.join()

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- planning (caller holds self._cond) ---------------------------------------------
    def _horizon_end(self, step: int) -> int:
        # Planning every ``_replan_every`` steps, the plan reaches that much further so the
        # steps [current, current + horizon) are always inside it.
        end = step + self.horizon + self._replan_every - 1
        return min(end, self.total_steps) if self.total_steps is not None else end

    def _refresh_plan(self) -> None:
        step = self._step  # read once: the training thread may move it meanwhile
        if self._plan_step >= 0 and 0 <= step - self._plan_step < self._replan_every:
            return
        end = self._horizon_end(step)
        uses = first_uses(self.schedule(step, end)) if end > step else {}
        self._plan_uses = uses
        self._plan = sorted(uses, key=lambda s: (uses[s], s))
        self._cached = {s for s in self._plan if self.cache.shard_cached(s)} | (
            self._cached - set(self._plan)
        )
        self._plan_step, self._plan_end = step, end

    def _plan_done(self) -> bool:
        return all(s in self._cached for s in self._plan)

    def _next_job(self) -> int | None:
        self._refresh_plan()
        for shard in self._plan:
            if shard in self._cached or shard in self._inflight:
                continue
            if self.cache.shard_cached(shard):
                self._cached.add(shard)
                continue
            if self.budget is not None and not self._make_room(self.cache.shard_bytes(shard)):
                return None  # everything cached is needed sooner: wait, never exceed budget
            return shard
        return None

    def _make_room(self, need: int) -> bool:
        """Evict furthest-next-use shards outside the horizon until ``need`` fits."""
        assert self.budget is not None
        n = self.cache.num_shards
        resident = [s for s in range(n) if self.cache.shard_cached(s)]
        # A shard still in our in-flight set may already be published (by our other fetch
        # thread, or by another rank's prefetcher sharing the cache): count its bytes once,
        # or every rank of a node evicts for room it already has.
        in_flight = sum(self.cache.shard_bytes(s) for s in self._inflight if s not in resident)
        used = sum(self.cache.shard_bytes(s) for s in resident) + in_flight
        if used + need <= self.budget:
            return True
        horizon = set(self._plan_uses)
        candidates = {s for s in resident if s not in horizon and s not in self._inflight}
        if not candidates:
            return False
        uses = next_uses(
            self.schedule,
            candidates,
            self._plan_end,
            window=self.horizon,
            limit=self.lookahead_limit,
        )
        for shard in sorted(candidates, key=lambda s: (-uses[s], s)):
            if used + need <= self.budget:
                break
            used -= self.cache.evict_shard(shard)
            self._cached.discard(shard)
            self.evicted.append((self._step, shard))
        return used + need <= self.budget

    # -- fetch threads -----------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop:
            self._wake.clear()  # before planning: an advance() from now on wakes us again
            with self._cond:
                job = self._next_job()
                if job is None:
                    self.cache.prefetch_ahead_steps = self.ahead_steps()
                    self._cond.notify_all()  # wait_idle() callers re-check
                else:
                    self._inflight.add(job)
            if job is None:
                self._wake.wait(timeout=0.5)
                continue
            try:
                self.cache.ensure_shard(job)
                ok = True
            except Exception as exc:  # the demand path raises it properly; keep prefetching
                ok = False
                self.errors += 1
                self.last_error = exc
                log.warning("prefetch of shard %d failed: %s", job, exc)
            with self._cond:
                self._inflight.discard(job)
                if ok:
                    self._cached.add(job)
                self.cache.prefetch_ahead_steps = self.ahead_steps()
                self._cond.notify_all()
            if not ok:
                self._stopped.wait(timeout=1.0)  # back off before retrying the same shard
