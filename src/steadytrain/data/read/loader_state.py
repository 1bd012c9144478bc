"""The loader's state dict: a stream position plus the settings that define the sample order.

Format (JSON, version 2; ``docs/format.md`` part B)::

    {"format": "steadytrain.loader", "version": 2,
     "step": 1234, "micro_in_step": 0, "position": 631808,
     "seq_len": 2048, "global_batch": 512, "micro_batch": 8, "seed": 0,
     "shuffle": "global", "mode_settings": {}, "blend_period": 1,
     "world_size": 8, "rank": 3, "fingerprint": "<combined>",
     "mixture": [{"fingerprint": "...", "weight": 1, "count": 1, "samples": 123}]}

``position`` is the stream position (in samples) where ``step`` starts, and it is what a
resume continues from: the order is a function of the position alone (DESIGN invariant 1),
so a state saved between steps loads with another global batch too, and the steps after it
take the new size from the saved sample on. Version 1 states (written before the global
batch could change) load as well: their position is ``step * global_batch``.

At a step boundary (``micro_in_step == 0``) the state is the same on every rank and loads on
any world size, micro-batch size, global batch or worker count. Loading checks every field
that changes the order and names both values when one differs.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import xxhash

from steadytrain.data.read.format import compute_fingerprint
from steadytrain.data.read.sampler import BatchPlan
from steadytrain.data.read.untrusted import short_repr as _short
from steadytrain.errors import LoaderStateError

__all__ = ["FORMAT", "VERSION", "Resume", "make_state", "check_state", "mixture_fingerprint"]

FORMAT = "steadytrain.loader"
VERSION = 2
_READS = (1, 2)  # version 1: no batch change possible, position == step * global_batch
# What the order of positions depends on; the global batch only cuts it into steps.
_ORDER_KEYS = ("seq_len", "seed", "shuffle", "mode_settings", "blend_period")
# Bounds of the saved cursor: 2**40 steps or samples is far past any run (Llama 3's 15T
# tokens are 7e9 samples of 2048), and keeps every position the loader derives from them
# (times a global batch, plus a rank offset) inside int64.
_MAX_CURSOR = 1 << 40
_MAX_BATCH = 1 << 20

log = logging.getLogger("steadytrain.data")


@dataclasses.dataclass(frozen=True)
class Resume:
    """Where a loader continues after ``load_state_dict``: its micro-batch cursor, the batch
    plan anchored at the saved (step, position), and what changed since the save (each a
    JSON object for the ledger; empty when nothing did)."""

    cursor: int
    plan: BatchPlan
    changes: list[dict[str, Any]]


def mixture_fingerprint(mixture: list[dict[str, Any]]) -> str:
    if len(mixture) == 1:
        return str(mixture[0]["fingerprint"])
    text = ";".join(f"{m['fingerprint']}*{m['count']}" for m in mixture)
    return xxhash.xxh3_128_hexdigest(text.encode())


def make_state(loader: Any, cursor: int | None = None) -> dict[str, Any]:
    """``loader``'s state after ``cursor`` micro-batches (default: those it handed out)."""
    m = loader.plan.micro_per_step
    cursor = loader._cursor if cursor is None else cursor
    step = cursor // m
    mixture = loader.sampler.mixture()
    return {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "micro_in_step": cursor % m,
        "position": loader.plan.step_start(step),
        **loader.sampler.settings(),
        "micro_batch": loader.micro_batch,
        "world_size": loader.world_size,
        "rank": loader.rank,
        "fingerprint": mixture_fingerprint(mixture),
        "mixture": mixture,
    }


def _fp(value: Any) -> str:
    """A saved fingerprint for a message: the string itself when it is one, else its repr."""
    if isinstance(value, str) and len(value) <= 80:
        return value
    return _short(value)


def _count(sd: dict[str, Any], key: str, low: int = 0, high: int = _MAX_CURSOR) -> int:
    """An integer field of the saved state in ``[low, high]``; the error names it."""
    value = sd.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise LoaderStateError(
            f"loader state has no valid {key} ({key}={_short(value)}, an integer is needed); "
            "the state is damaged: resume from another checkpoint"
        )
    if value < low:
        what = "a negative cursor" if low == 0 else f"{key} below {low}"
        raise LoaderStateError(
            f"loader state has {what} ({key}={_short(value)}); the state is damaged: resume from "
            "another checkpoint"
        )
    if value > high:
        raise LoaderStateError(
            f"loader state has {key}={_short(value)}, beyond any run (at most {high}); the "
            "state is damaged: resume from another checkpoint"
        )
    return value


def _fingerprint_error(loader: Any, sd: dict[str, Any], mine: dict[str, Any], step: int) -> str:
    """Why the saved fingerprint differs, for the error. A state saved against a dataset
    whose manifest predates the document index in the fingerprint (scheme 1) carries that
    dataset's legacy fingerprint: say so, since the data may be the same tokens cut into
    other documents, and nothing here can tell (format.md A.4)."""
    saved = sd.get("fingerprint")
    legacy = []
    for ds in loader.datasets:
        m = getattr(ds, "manifest", None)
        if m is None or getattr(m, "fingerprint_version", 1) == 1:
            continue
        legacy.append(
            compute_fingerprint(m.dtype, m.vocab_size, m.eos_id, list(m.shards), scheme=1)
        )
    saved_mix = sd.get("mixture") if isinstance(sd.get("mixture"), list) else []
    saved_fps = [saved] + [m.get("fingerprint") for m in saved_mix if isinstance(m, dict)]
    if any(isinstance(fp, str) and fp in legacy for fp in saved_fps):
        return (
            f"saved with dataset fingerprint {_fp(saved)}, the legacy (scheme 1) fingerprint "
            f"of this data, which did not cover the document index; the loader has "
            f"{mine['fingerprint']} (scheme 2, covering it). The token files are the same but "
            f"the document boundaries may differ, which this state cannot show. If they are "
            f"unchanged (`steadytrain verify DATASET`, and the data was not re-cut), pass "
            f"allow_dataset_change=True to continue from step {step}; otherwise resume from a "
            f"checkpoint saved with this dataset"
        )
    return (
        f"saved with dataset fingerprint {_fp(saved)}, loader has "
        f"{mine['fingerprint']}: the data changed since the checkpoint, so the saved "
        f"position means other samples. Pass allow_dataset_change=True to continue from "
        f"step {step} on the new data anyway"
    )


def check_state(loader: Any, sd: Any) -> Resume:
    """Validate ``sd`` against ``loader`` (changing nothing); return where to resume."""
    if not isinstance(sd, dict) or sd.get("format") != FORMAT:
        found = sd.get("format") if isinstance(sd, dict) else type(sd).__name__
        raise LoaderStateError(
            f"not a steadytrain loader state (format={_short(found)}); was it saved by another "
            "loader?"
        )
    version = sd.get("version")
    if isinstance(version, bool) or version not in _READS:
        raise LoaderStateError(
            f"loader state version {_short(version)} is not supported (this steadytrain reads "
            f"versions {', '.join(map(str, _READS))}); upgrade steadytrain"
        )
    mine = make_state(loader)
    for key in _ORDER_KEYS:
        if sd.get(key) != mine[key]:
            raise LoaderStateError(
                f"saved with {key}={_short(sd.get(key))}, loader has {key}={mine[key]!r}: the "
                f"sample order would differ; construct the loader with "
                f"{key}={_short(sd.get(key))}"
            )
    saved_mix, my_mix = sd.get("mixture") or [], mine["mixture"]
    if not isinstance(saved_mix, list) or not all(isinstance(m, dict) for m in saved_mix):
        raise LoaderStateError(
            f"loader state has a malformed mixture {_short(saved_mix)}; the state is damaged: "
            "resume from another checkpoint"
        )
    if [(m.get("weight"), m.get("count")) for m in saved_mix] != [
        (m["weight"], m["count"]) for m in my_mix
    ]:
        raise LoaderStateError(
            f"saved with mixture weights {_short([m.get('weight') for m in saved_mix])}, loader "
            f"has {[m['weight'] for m in my_mix]}: the blend would differ"
        )
    step, micro = _count(sd, "step"), _count(sd, "micro_in_step")
    if sd.get("fingerprint") != mine["fingerprint"] and not loader.allow_dataset_change:
        raise LoaderStateError(_fingerprint_error(loader, sd, mine, step))
    saved_batch = _count(sd, "global_batch", low=1, high=_MAX_BATCH)
    position = _count(sd, "position") if version >= 2 else step * saved_batch
    plan: BatchPlan = loader.plan
    if micro:
        for key in ("global_batch", "world_size", "rank", "micro_batch"):
            if sd.get(key) != mine[key]:
                raise LoaderStateError(
                    f"saved mid-step (micro_in_step={micro}) with {key}={_short(sd.get(key))}, loader "
                    f"has {key}={mine[key]!r}: a state saved between steps loads on any "
                    f"{key}; one saved mid-step only on the same one"
                )
        if micro >= plan.micro_per_step:
            raise LoaderStateError(
                f"loader state has micro_in_step={micro}, but a step has only "
                f"{plan.micro_per_step} micro-batches; the state is damaged"
            )
    changes = []
    if saved_batch != loader.global_batch:
        changes.append(
            {
                "key": "global_batch",
                "old": saved_batch,
                "new": loader.global_batch,
                "step": step,
                "position": position,
            }
        )
    anchored = dataclasses.replace(plan, origin_step=step, origin_position=position)
    return Resume(step * plan.micro_per_step + micro, anchored, changes)


def log_changes(changes: list[dict[str, Any]]) -> None:
    """Say in the log what a resume changed (the ledger gets it through the restore event)."""
    for c in changes:
        log.warning(
            "resuming with %s=%s (saved with %s) at step %d, sample position %d: the stream "
            "continues at that sample, %s samples per step from here on",
            c["key"],
            c["new"],
            c["old"],
            c["step"],
            c["position"],
            c["new"],
        )
