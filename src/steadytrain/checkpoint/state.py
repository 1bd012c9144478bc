"""What goes into a checkpoint: tensors through DCP, small state as JSON, RNG per rank.

A ``states`` dict maps names to objects. Each is split by kind:

- ``nn.Module`` / ``Optimizer``: through DCP's ``get_state_dict``/``set_state_dict``, so DDP
  and FSDP2 (DTensor) state is saved sharded and resharded on load to any world size.
- anything else with ``state_dict()``/``load_state_dict()`` (LR scheduler, TokenLoader, user
  objects): if its state dict is JSON-serialisable it is stored in ``state-rankNNNNN.json``
  (no pickle involved on load); otherwise it goes through DCP with the tensors.
- per-rank RNG (Python, NumPy, torch CPU, CUDA when present): in the same JSON file.

RNG on a world-size change: rank ``r`` restores the RNG it saved when ``r`` was a saved
rank; a rank beyond the saved world gets generators seeded from ``derive_seed(step, r)``
(deterministic, distinct per rank). JSON states (loader, scheduler) come from the same rank's
file when it exists, otherwise from rank 0's (loader state is rank-independent by design).
"""

from __future__ import annotations

import base64
import hashlib
import json
import random
from typing import Any

import numpy as np
import torch
from torch import nn

from steadytrain.errors import CheckpointError

__all__ = [
    "parse_rank_json",
    "split_states",
    "dcp_state_dict",
    "apply_dcp_state_dict",
    "json_states",
    "check_json_states",
    "apply_json_states",
    "json_state_changes",
    "rng_state",
    "set_rng_state",
    "derive_seed",
]


def _is_jsonable(obj: Any) -> bool:
    try:
        json.dumps(obj, allow_nan=True)
    except (TypeError, ValueError):
        return False
    return True


def split_states(states: dict[str, Any]) -> tuple[dict, dict, dict]:
    """Return (modules, optimizers, others) from a user ``states`` dict."""
    modules, optims, others = {}, {}, {}
    for name, obj in states.items():
        if not isinstance(name, str) or not name or "/" in name or name.startswith("_"):
            raise ValueError(f"state name {name!r} must be a non-empty str without '/' or '_'")
        if isinstance(obj, nn.Module):
            modules[name] = obj
        elif isinstance(obj, torch.optim.Optimizer):
            optims[name] = obj
        elif callable(getattr(obj, "state_dict", None)) and callable(
            getattr(obj, "load_state_dict", None)
        ):
            others[name] = obj
        else:
            raise TypeError(
                f"states[{name!r}] is a {type(obj).__name__}: pass an nn.Module, an Optimizer "
                "or an object with state_dict()/load_state_dict()"
            )
    return modules, optims, others


def _owner(optim: torch.optim.Optimizer, modules: dict[str, nn.Module]) -> nn.Module | None:
    """The module whose parameters this optimizer updates (needed for FQN-keyed state)."""
    ids = {id(p) for g in optim.param_groups for p in g["params"]}
    for mod in modules.values():
        if ids and ids <= {id(p) for p in mod.parameters()}:
            return mod
    return None


def dcp_state_dict(states: dict[str, Any]) -> dict[str, Any]:
    """The tensor part of ``states`` as a DCP state dict (aliases live tensors: stage it)."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    modules, optims, others = split_states(states)
    out: dict[str, Any] = {}
    for name, mod in modules.items():
        out[name] = get_model_state_dict(mod)
    for name, opt in optims.items():
        owner = _owner(opt, modules)
        out[name] = opt.state_dict() if owner is None else get_optimizer_state_dict(owner, opt)
    for name, obj in others.items():
        sd = obj.state_dict()
        if not _is_jsonable(sd):
            out[name] = sd
    return out


def apply_dcp_state_dict(states: dict[str, Any], loaded: dict[str, Any]) -> None:
    """Push a DCP-loaded state dict (same shape as ``dcp_state_dict``) into live objects."""
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    modules, optims, others = split_states(states)
    for name, mod in modules.items():
        set_model_state_dict(mod, loaded[name])
    for name, opt in optims.items():
        owner = _owner(opt, modules)
        if owner is None:
            opt.load_state_dict(loaded[name])
        else:
            set_optimizer_state_dict(owner, opt, loaded[name])
    for name, obj in others.items():
        if name in loaded:
            obj.load_state_dict(loaded[name])


def json_states(states: dict[str, Any]) -> dict[str, Any]:
    """The JSON-serialisable states (loader, scheduler, user objects) by name."""
    _, _, others = split_states(states)
    out = {}
    for name, obj in others.items():
        sd = obj.state_dict()
        if _is_jsonable(sd):
            out[name] = json.loads(json.dumps(sd))  # a deep, detached copy
    return out


def check_json_states(states: dict[str, Any], saved: dict[str, Any]) -> None:
    """Refuse, before anything is loaded, JSON states that would not load: a missing name
    (``CheckpointError``) or a state its object's ``check_state_dict`` refuses (the loader's
    ``LoaderStateError``: another seq_len, seed, mixture or dataset). Changes nothing."""
    from steadytrain.errors import CheckpointError

    _, _, others = split_states(states)
    for name, obj in others.items():
        if name in saved:
            check = getattr(obj, "check_state_dict", None)
            if callable(check):
                check(saved[name])
        elif _is_jsonable(obj.state_dict()):
            raise CheckpointError(
                f"the checkpoint has no state named {name!r} (it has {sorted(saved)}); "
                "pass the same names to restore_latest() that were passed to save()"
            )


def apply_json_states(states: dict[str, Any], saved: dict[str, Any]) -> None:
    """Load each JSON state into its object; a missing name is a clear error."""
    check_json_states(states, saved)
    _, _, others = split_states(states)
    for name, obj in others.items():
        if name in saved:
            obj.load_state_dict(saved[name])


def json_state_changes(states: dict[str, Any]) -> list[dict[str, Any]]:
    """What loading changed, as the objects report it (``resume_changes``: the loader's new
    global batch, with the step and sample position it takes effect at), each tagged with
    its state's name: the restore event carries them into the ledger."""
    _, _, others = split_states(states)
    out = []
    for name, obj in others.items():
        for change in getattr(obj, "resume_changes", None) or []:
            out.append({"state": name, **change})
    return out


def derive_seed(step: int, rank: int) -> int:
    """A deterministic 63-bit seed for ``rank`` at ``step`` (used beyond the saved ranks)."""
    digest = hashlib.blake2b(f"steadytrain-rng:{step}:{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def rng_state() -> dict[str, Any]:
    """This process's RNG states in a JSON-serialisable form."""
    py = random.getstate()
    np_state = np.random.get_state(legacy=False)
    out: dict[str, Any] = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": [int(x) for x in np_state["state"]["key"]],
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [
            base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()
        ]
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state`` captured."""
    ver, internal, gauss = state["python"]
    random.setstate((ver, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": n["bit_generator"],
            "state": {"key": np.array(n["key"], dtype=np.uint32), "pos": n["pos"]},
            "has_gauss": n["has_gauss"],
            "gauss": n["gauss"],
        }
    )
    raw = np.frombuffer(base64.b64decode(state["torch"]), dtype=np.uint8).copy()
    torch.set_rng_state(torch.from_numpy(raw))
    if "cuda" in state and torch.cuda.is_available():
        cuda = [
            torch.from_numpy(np.frombuffer(base64.b64decode(s), dtype=np.uint8).copy())
            for s in state["cuda"]
        ]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)


def check_rng_state(state: Any) -> None:
    """Raise (any exception) unless ``set_rng_state(state)`` would succeed: each generator
    is set on a private instance, so nothing of this process's RNG changes. A checkpoint's
    ``rng`` is untrusted input, checked before any tensor is loaded."""
    ver, internal, gauss = state["python"]
    random.Random().setstate((ver, tuple(internal), gauss))
    n = state["numpy"]
    key = np.array(n["key"], dtype=np.int64)  # range-checked below: no silent wrap-around
    if key.ndim != 1 or ((key < 0) | (key >= 2**32)).any():
        raise ValueError("numpy key is not a list of 32-bit unsigned integers")
    np.random.RandomState().set_state(
        {
            "bit_generator": n["bit_generator"],
            "state": {"key": key.astype(np.uint32), "pos": n["pos"]},
            "has_gauss": n["has_gauss"],
            "gauss": n["gauss"],
        }
    )
    raw = np.frombuffer(base64.b64decode(state["torch"], validate=True), dtype=np.uint8)
    torch.Generator().set_state(torch.from_numpy(raw.copy()))
    if not isinstance(state.get("cuda", []), list) or not all(
        isinstance(c, str) for c in state.get("cuda", [])
    ):
        raise ValueError("cuda is not a list of base64 strings")


def parse_rank_json(raw: bytes, where: str) -> dict[str, Any]:
    """A rank's ``state-rankNNNNN.json`` (its bytes already checked against COMMIT) as the
    object a save writes, with a ``states`` object; CheckpointError naming ``where``
    otherwise. The one parser of these files (restore, export): a document nested deeper
    than the interpreter can parse (``json.loads`` raises ``RecursionError`` on 100k
    brackets) is refused like any other damage, never a traceback."""
    try:
        doc = json.loads(raw)
    except RecursionError:
        raise CheckpointError(
            f"{where}: nests too deeply to be a state a save writes; the file is damaged"
        ) from None
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise CheckpointError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("states"), dict):
        raise CheckpointError(f'{where}: has no "states" object')
    return doc


def seed_rng(seed: int) -> None:
    """Seed every generator from one integer (ranks beyond the saved world)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
