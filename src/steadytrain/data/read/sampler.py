"""The pure position -> sample mapping (DESIGN invariants 1 and 2).

Sample space: a sample is ``seq_len + 1`` consecutive tokens of one shard's token stream;
shard ``s`` holds ``(tokens_s - 1) // seq_len`` samples, sample ``i`` of it starting at token
``i * seq_len`` (consecutive samples overlap by the one token that is both the last label of
one and the first input of the next). Global sample ids number the shards' samples in order;
id -> (shard, offset) is a binary search over the cumulative counts. Memory O(#shards).

Stream: position ``k`` (0, 1, 2, ... forever) -> dataset ``d`` and its local position ``j``
(closed-form blend, ``blend.py``) -> epoch ``j // N_d`` and in-epoch position ``j % N_d`` ->
sample id through the dataset's order (``modes/``, re-keyed per epoch and per dataset).
Step ``s`` consumes positions ``[s G, (s + 1) G)`` (after a resume with another global batch,
``G``-sized steps from the saved sample position on); ``BatchPlan`` cuts that range into rank
slices and micro-batches. The sample at a position depends on none of the world size, the
worker count, the global batch or history.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

from steadytrain.data.read.blend import Blend, quantise_weights
from steadytrain.data.read.modes import make_order
from steadytrain.data.read.permute import derive_key
from steadytrain.errors import ConfigError

__all__ = ["Source", "Sampler", "BatchPlan", "Refs"]


@dataclasses.dataclass(frozen=True)
class Source:
    """What the sampler needs to know about one dataset: O(#shards) integers."""

    fingerprint: str
    token_counts: np.ndarray
    itemsize: int
    shard_bytes: np.ndarray

    @classmethod
    def of(cls, obj: Any) -> Source:
        """From a ``TokenDataset``, a ``Manifest`` or a ``Source``."""
        if isinstance(obj, Source):
            return obj
        manifest = getattr(obj, "manifest", obj)
        counts = np.fromiter((s.tokens for s in manifest.shards), dtype=np.int64)
        return cls(manifest.fingerprint, counts, manifest.itemsize, counts * manifest.itemsize)


class Refs(NamedTuple):
    """Where each sample of a batch lives: arrays of equal length (a tuple: cheap to make)."""

    dataset: np.ndarray
    shard: np.ndarray
    offset: np.ndarray  # first token of the sample within its shard
    sample_id: np.ndarray  # global id: datasets' sample spaces concatenated


class Sampler:
    """Position -> (dataset, shard, token offset, sample id), for any position, in O(1)."""

    def __init__(
        self,
        sources: Sequence[Any],
        seq_len: int,
        global_batch: int,
        *,
        seed: int = 0,
        mode: str = "global",
        mode_settings: dict[str, Any] | None = None,
        weights: Sequence[float] | None = None,
        blend_period: int | None = None,
    ) -> None:
        if seq_len < 1 or global_batch < 1:
            raise ConfigError(
                f"seq_len and global_batch must be >= 1, got {seq_len} and {global_batch}"
            )
        if not sources:
            raise ConfigError("the sampler needs at least one dataset")
        self.sources = [Source.of(s) for s in sources]
        self.seq_len, self.global_batch, self.seed = int(seq_len), int(global_batch), int(seed)
        self.mode = mode
        self.weights = list(weights) if weights is not None else [1] * len(self.sources)
        if len(self.weights) != len(self.sources):
            raise ConfigError(
                f"{len(self.weights)} weights for {len(self.sources)} datasets: give one each"
            )
        self.blend = Blend(quantise_weights(self.weights, blend_period))
        self.cum: list[np.ndarray] = []
        for d, src in enumerate(self.sources):
            counts = np.maximum(src.token_counts - 1, 0) // self.seq_len
            cum = np.zeros(counts.size + 1, dtype=np.int64)
            np.cumsum(counts, out=cum[1:])
            if cum[-1] == 0:
                raise ConfigError(
                    f"dataset {d} ({src.fingerprint[:12]}) has no shard with more than "
                    f"seq_len={self.seq_len} tokens: nothing to sample; use a smaller seq_len"
                )
            self.cum.append(cum)
        self.num_samples = [int(c[-1]) for c in self.cum]
        self.base = np.concatenate([[0], np.cumsum(self.num_samples)]).astype(np.int64)
        settings = dict(mode_settings or {})
        self.orders = [
            make_order(mode, n, derive_key(self.seed, d), settings)
            for d, n in enumerate(self.num_samples)
        ]

    # -- the mapping -------------------------------------------------------------------
    def locate(self, positions: np.ndarray) -> Refs:
        """Where the samples at stream ``positions`` (int64 array) live."""
        k = np.asarray(positions, dtype=np.int64).ravel()
        dataset, local = self.blend.assign(k)
        ids = np.empty_like(k)
        for d in np.unique(dataset) if len(self.sources) > 1 else (0,):
            sel = slice(None) if len(self.sources) == 1 else dataset == d
            epoch, i = np.divmod(local[sel], self.num_samples[d])
            if epoch.size and epoch[0] == epoch[-1]:  # positions ascend: one epoch, usually
                ids[sel] = self.orders[d].ids(i, int(epoch[0]))
            else:
                out = np.empty_like(i)
                for e in np.unique(epoch):
                    part = epoch == e
                    out[part] = self.orders[d].ids(i[part], int(e))
                ids[sel] = out
        shard = np.empty_like(k)
        offset = np.empty_like(k)
        for d in np.unique(dataset) if len(self.sources) > 1 else (0,):
            sel = slice(None) if len(self.sources) == 1 else dataset == d
            cum = self.cum[d]
            s = np.searchsorted(cum, ids[sel], side="right") - 1
            shard[sel] = s
            offset[sel] = (ids[sel] - cum[s]) * self.seq_len
        return Refs(dataset, shard, offset, self.base[dataset] + ids)

    def positions_of_step(self, step: int) -> np.ndarray:
        return np.arange(step * self.global_batch, (step + 1) * self.global_batch, dtype=np.int64)

    # -- description -------------------------------------------------------------------
    def mixture(self) -> list[dict[str, Any]]:
        """The fingerprinted mixture: which datasets, in which proportions."""
        return [
            {"fingerprint": s.fingerprint, "weight": w, "count": c, "samples": n}
            for s, w, c, n in zip(
                self.sources, self.weights, self.blend.counts, self.num_samples, strict=True
            )
        ]

    def settings(self) -> dict[str, Any]:
        return {
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "seed": self.seed,
            "shuffle": self.mode,
            "mode_settings": self.orders[0].settings(),
            "blend_period": self.blend.period,
        }

    def steps_per_epoch(self, dataset: int = 0) -> float:
        """Steps until ``dataset`` has served each of its samples once."""
        share = self.blend.counts[dataset] / self.blend.period
        return self.num_samples[dataset] / (share * self.global_batch)

    def cache_need(self, dataset: int = 0) -> dict[str, int]:
        """How much of ``dataset`` a node must hold at once to never wait, from the settings.

        ``block`` mode: the current and the next window (``2 W B`` samples); a window's
        ``W`` blocks each span at most ``ceil(B / min samples per shard) + 1`` shards.
        ``sequential``: the current and the next shard. ``global``: every shard.
        """
        src, cum = self.sources[dataset], self.cum[dataset]
        counts = np.diff(cum)
        nonzero = counts[counts > 0]
        n_shards = int(nonzero.size)
        sample_bytes = (self.seq_len + 1) * src.itemsize
        order = self.orders[dataset]
        if self.mode == "block":
            per_block = -(-order.block_size // int(nonzero.min())) + 1
            shards = min(n_shards, 2 * order.window_blocks * per_block)
            window_samples = order.window
        elif self.mode == "sequential":
            shards, window_samples = min(n_shards, 2), self.global_batch
        else:
            shards, window_samples = n_shards, self.num_samples[dataset]
        largest = np.sort(src.shard_bytes)[::-1]
        return {
            "cache_need_shards": shards,
            "cache_need_bytes": int(largest[:shards].sum()),
            "window_samples": int(window_samples),
            "window_bytes": int(window_samples) * sample_bytes,
        }

    # -- look-ahead for the shard cache ------------------------------------------------
    def shards_for_steps(
        self,
        start: int,
        stop: int,
        *,
        ranks: Iterable[int] | None = None,
        world_size: int = 1,
        dataset: int = 0,
        origin: tuple[int, int] = (0, 0),
    ) -> list[tuple[int, int]]:
        """``(step, shard)`` for each shard of ``dataset`` that steps ``[start, stop)`` read,
        in order of first use (the step is the first one that needs it).

        ``origin=(step, position)``: the step that starts at that stream position (a loader
        resumed with another global batch; ``BatchPlan.step_start``); steps before it are
        not looked at.

        ``ranks=None`` means every rank (the whole job, or a node that shares one cache);
        otherwise only the positions of those ranks of ``world_size`` count. ``sequential``
        is exact, ``block`` reports a window's shards at the window's first step (the window
        is what the cache must hold), ``global`` is exact and stops once every shard is seen.
        """
        if not 0 <= start <= stop:
            raise ConfigError(f"step range [{start}, {stop}) is not a valid range")
        intervals: list[tuple[int, int]]
        g = self.global_batch
        step0, pos0 = origin
        start = max(start, step0)
        stop = max(stop, start)

        def begin(step: int) -> int:
            return pos0 + (step - step0) * g

        if ranks is None:
            intervals = [(begin(start), begin(stop))]
        else:
            if g % world_size:
                raise ConfigError(f"world_size={world_size} does not divide global_batch={g}")
            per = g // world_size
            rs = sorted(set(int(r) for r in ranks))
            if rs and not 0 <= rs[0] <= rs[-1] < world_size:
                raise ConfigError(f"ranks {rs} outside [0, {world_size})")
            groups: list[list[int]] = []
            for r in rs:  # contiguous runs of ranks read contiguous positions
                if groups and groups[-1][1] == r:
                    groups[-1][1] = r + 1
                else:
                    groups.append([r, r + 1])
            intervals = [
                (begin(s) + a * per, begin(s) + b * per)
                for s in range(start, stop)
                for a, b in groups
            ]
        seen: dict[int, int] = {}
        total = int(np.count_nonzero(np.diff(self.cum[dataset])))
        for p0, p1 in intervals:
            self._first_uses(dataset, p0, p1, seen, origin)
            if len(seen) == total:
                break
        return sorted(((step, shard) for shard, step in seen.items()), key=lambda t: t[0])

    def _first_uses(
        self, d: int, p0: int, p1: int, seen: dict[int, int], origin: tuple[int, int]
    ) -> None:
        n, cum, total = (
            self.num_samples[d],
            self.cum[d],
            int(np.count_nonzero(np.diff(self.cum[d]))),
        )
        lo, hi = self.blend.count_before(d, p0), self.blend.count_before(d, p1)
        j = lo
        while j < hi and len(seen) < total:
            epoch, i_lo = divmod(j, n)
            i_hi = min(n, i_lo + (hi - j))
            for first, id_lo, id_hi in self.orders[d].spans(i_lo, i_hi, epoch):
                s_lo = np.searchsorted(cum, id_lo, side="right") - 1
                s_hi = np.searchsorted(cum, id_hi - 1, side="right")  # exclusive
                width = s_hi - s_lo
                shards = np.repeat(s_lo - np.cumsum(np.r_[0, width[:-1]]), width)
                shards += np.arange(shards.size)
                starts = np.repeat(first, width)
                if self.mode == "sequential":  # ids follow positions: exact per shard
                    starts += np.maximum(cum[shards], np.repeat(id_lo, width)) - np.repeat(
                        id_lo, width
                    )
                used = cum[shards + 1] > cum[shards]  # shards too short for a sample
                shards, starts = shards[used], starts[used]
                positions = self.blend.position_of(d, epoch * n + starts)
                steps = origin[0] + (positions - origin[1]) // self.global_batch
                for shard, step in zip(shards.tolist(), steps.tolist(), strict=True):
                    if shard not in seen:
                        seen[shard] = step
                if len(seen) == total:
                    return
            j += i_hi - i_lo


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """Rank slice and micro-batch split of every step: plain integers (DESIGN invariant 1).

    Step ``s`` starts at stream position ``start(s) = P0 + (s - S0) G``, where the origin
    ``(S0, P0)`` is ``(0, 0)`` for a fresh run and the saved (step, sample position) after a
    resume: the stream is positional, so a job resumed with another global batch continues
    at the saved sample and only the size of the steps after it changes. Rank ``r`` of ``W``
    reads positions ``[start(s) + r G/W, start(s) + (r+1) G/W)`` of step ``s`` as
    ``G / W / micro_batch`` micro-batches; its ``q``-th micro-batch overall is micro-batch
    ``q % M`` of step ``q // M``. Loader worker ``q % num_workers`` produces it.
    """

    global_batch: int
    micro_batch: int
    rank: int = 0
    world_size: int = 1
    origin_step: int = 0  # the step that starts at origin_position (a resume point)
    origin_position: int = 0

    def __post_init__(self) -> None:
        g, w, mb = self.global_batch, self.world_size, self.micro_batch
        if self.origin_step < 0 or self.origin_position < 0:
            raise ConfigError(
                f"origin step {self.origin_step} / position {self.origin_position}: "
                "a resume point is never negative"
            )
        if w < 1 or not 0 <= self.rank < w:
            raise ConfigError(f"rank={self.rank} must lie in [0, world_size={w})")
        if g % w:
            raise ConfigError(
                f"world_size={w} does not divide global_batch={g}: every rank must read the "
                f"same number of samples per step; choose a global_batch that is a multiple of {w}"
            )
        if mb < 1 or (g // w) % mb:
            raise ConfigError(
                f"micro_batch={mb} does not divide the per-rank batch {g // w} "
                f"(global_batch={g} / world_size={w})"
            )

    @property
    def per_rank(self) -> int:
        return self.global_batch // self.world_size

    @property
    def micro_per_step(self) -> int:
        return self.per_rank // self.micro_batch

    def step_start(self, step: int) -> int:
        """Stream position of the first sample of ``step`` (all ranks)."""
        return self.origin_position + (step - self.origin_step) * self.global_batch

    def positions(self, q_lo: int, q_hi: int) -> np.ndarray:
        """Stream positions of this rank's micro-batches ``[q_lo, q_hi)``, shape [q, mb]."""
        q = np.arange(q_lo, q_hi, dtype=np.int64)
        step, m = np.divmod(q, self.micro_per_step)
        start = (
            self.origin_position
            + (step - self.origin_step) * self.global_batch
            + self.rank * self.per_rank
            + m * self.micro_batch
        )
        if self.origin_step:
            # Steps before a resume point are never served (the cursor starts at it), but a
            # reader maps positions a chunk at a time from a round micro-batch index, so a
            # chunk may begin before it: those rows are clamped to a valid position.
            np.maximum(start, 0, out=start)
        return start[:, None] + np.arange(self.micro_batch, dtype=np.int64)[None, :]
