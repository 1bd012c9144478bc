"""The loader's state dict: a cursor plus the settings that define the sample order.

Format (JSON, version 1)::

    {"format": "steadytrain.loader", "version": 1,
     "step": 1234, "micro_in_step": 0, "position": 1234 * global_batch,
     "seq_len": 2048, "global_batch": 512, "micro_batch": 8, "seed": 0,
     "shuffle": "global", "mode_settings": {}, "blend_period": 1,
     "world_size": 8, "rank": 3, "fingerprint": "<combined>",
     "mixture": [{"fingerprint": "...", "weight": 1, "count": 1, "samples": 123}]}

At a step boundary (``micro_in_step == 0``) the state is the same on every rank and loads on
any world size, micro-batch size or worker count. Loading checks every field that changes
the order and names both values when one differs.
"""

from __future__ import annotations

from typing import Any

import xxhash

from steadytrain.errors import LoaderStateError

FORMAT = "steadytrain.loader"
VERSION = 1
_ORDER_KEYS = ("seq_len", "global_batch", "seed", "shuffle", "mode_settings", "blend_period")


def mixture_fingerprint(mixture: list[dict[str, Any]]) -> str:
    if len(mixture) == 1:
        return str(mixture[0]["fingerprint"])
    text = ";".join(f"{m['fingerprint']}*{m['count']}" for m in mixture)
    return xxhash.xxh3_128_hexdigest(text.encode())


def make_state(loader: Any) -> dict[str, Any]:
    m = loader.plan.micro_per_step
    mixture = loader.sampler.mixture()
    return {
        "format": FORMAT,
        "version": VERSION,
        "step": loader._cursor // m,
        "micro_in_step": loader._cursor % m,
        "position": (loader._cursor // m) * loader.global_batch,
        **loader.sampler.settings(),
        "micro_batch": loader.micro_batch,
        "world_size": loader.world_size,
        "rank": loader.rank,
        "fingerprint": mixture_fingerprint(mixture),
        "mixture": mixture,
    }


def check_state(loader: Any, sd: Any) -> int:
    """Validate ``sd`` against ``loader``; return the cursor (micro-batch index) to resume at."""
    if not isinstance(sd, dict) or sd.get("format") != FORMAT:
        raise LoaderStateError(
            f"not a steadytrain loader state (format={sd.get('format') if isinstance(sd, dict) else type(sd).__name__!r}); "
            f"was it saved by another loader?"
        )
    if sd.get("version") != VERSION:
        raise LoaderStateError(
            f"loader state version {sd.get('version')!r} is not supported (this steadytrain "
            f"reads version {VERSION})"
        )
    mine = make_state(loader)
    for key in _ORDER_KEYS:
        if sd.get(key) != mine[key]:
            raise LoaderStateError(
                f"saved with {key}={sd.get(key)!r}, loader has {key}={mine[key]!r}: the sample "
                f"order would differ; construct the loader with {key}={sd.get(key)!r}"
            )
    saved_mix, my_mix = sd.get("mixture") or [], mine["mixture"]
    if [(m.get("weight"), m.get("count")) for m in saved_mix] != [
        (m["weight"], m["count"]) for m in my_mix
    ]:
        raise LoaderStateError(
            f"saved with mixture weights {[m.get('weight') for m in saved_mix]}, loader has "
            f"{[m['weight'] for m in my_mix]}: the blend would differ"
        )
    if sd.get("fingerprint") != mine["fingerprint"] and not loader.allow_dataset_change:
        raise LoaderStateError(
            f"saved with dataset fingerprint {sd.get('fingerprint')}, loader has "
            f"{mine['fingerprint']}: the data changed since the checkpoint, so the saved "
            f"position means other samples. Pass allow_dataset_change=True to continue from "
            f"step {sd.get('step')} on the new data anyway"
        )
    try:
        step, micro = int(sd["step"]), int(sd["micro_in_step"])
    except (KeyError, TypeError, ValueError) as exc:
        raise LoaderStateError(f"loader state has no valid step/micro_in_step ({exc!r})") from exc
    if step < 0 or micro < 0:
        raise LoaderStateError(f"loader state has a negative cursor (step={step}, micro={micro})")
    if micro:
        for key in ("world_size", "rank", "micro_batch"):
            if sd.get(key) != mine[key]:
                raise LoaderStateError(
                    f"saved mid-step (micro_in_step={micro}) with {key}={sd.get(key)!r}, loader "
                    f"has {key}={mine[key]!r}: a state saved between steps loads on any "
                    f"{key}; one saved mid-step only on the same one"
                )
    return step * loader.plan.micro_per_step + micro
