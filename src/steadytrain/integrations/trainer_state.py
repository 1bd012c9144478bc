"""A trainer's own state in a steadytrain checkpoint: JSON, tensors tagged, checked on load.

What Lightning's and HF's Trainer keep besides the weights and optimizer moments (loop
progress, callbacks' states, schedulers, ``TrainerState``, hyperparameters) is small and
mostly JSON already, with a few small tensors in it (``ModelCheckpoint``'s best scores).
It goes into the checkpoint as a JSON state (``state-rankNNNNN.json``, docs/format.md), not
through DCP: DCP loads a nested dict only at the keys of a template built from the live
objects, and these dicts change keys as training goes (``ModelCheckpoint``'s
``best_k_models`` is keyed by path), so a DCP round trip would drop entries.

The encoding (``to_json``/``from_json``) keeps every value JSON can hold as itself and tags
the rest with one key, ``"__steadytrain__"``:

- a tensor: ``{"__steadytrain__": "tensor", "dtype", "shape", "data"}`` (its bytes, base64);
- a tuple, or a dict whose keys are not all strings (or that holds the tag key):
  ``{"__steadytrain__": "tuple" | "dict", "items": [...]}``;
- any other object: ``{"__steadytrain__": "pickle", "type", "data"}``, ``torch.save``'s bytes,
  loaded with ``torch.load(weights_only=True)`` -- what Lightning itself loads by default --
  so an object that would need arbitrary code to unpickle is refused, naming its key; an
  object ``torch.save`` cannot write at all is saved as ``"unsaved"`` (loaded as None), with
  a warning when saving: a hyperparameter that cannot be pickled must not stop training.

``TrainerMeta`` and ``LoaderPosition`` are the two states a trainer integration adds to
``Run``'s ``states``: the trainer's metadata (through a getter and a setter) and the
``TokenLoader``'s position as of the last micro-batch trained on.
"""

from __future__ import annotations

import base64
import io
import warnings
from collections.abc import Callable
from typing import Any

import torch

from steadytrain.errors import CheckpointError

__all__ = ["LoaderPosition", "TAG", "TrainerMeta", "from_json", "to_json"]

TAG = "__steadytrain__"
FORMAT = 1


def to_json(obj: Any, where: str = "") -> Any:
    """``obj`` as JSON values (module docstring); ``where`` names it in a warning."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, list):
        return [to_json(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and TAG not in obj:
            return {k: to_json(v, f"{where}.{k}") for k, v in obj.items()}
        items = [[to_json(k, where), to_json(v, f"{where}.{k}")] for k, v in obj.items()]
        return {TAG: "dict", "items": items}
    if isinstance(obj, tuple):
        return {TAG: "tuple", "items": [to_json(v, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        data = base64.b64encode(raw).decode()
        return {TAG: "tensor", "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape), "data": data}  # fmt: skip
    if hasattr(obj, "item") and getattr(obj, "shape", None) == ():  # a numpy scalar
        return to_json(obj.item(), where)
    buf = io.BytesIO()
    try:
        torch.save(obj, buf)
    except Exception as exc:  # noqa: BLE001 - a value that cannot be saved must not stop training
        warnings.warn(
            f"steadytrain: the trainer state {where or '(top)'} holds a {type(obj).__name__} "
            f"that cannot be saved ({type(exc).__name__}: {exc}); it is restored as None",
            RuntimeWarning,
            stacklevel=2,
        )
        return {TAG: "unsaved", "type": type(obj).__name__}
    return {TAG: "pickle", "type": type(obj).__name__,
            "data": base64.b64encode(buf.getvalue()).decode()}  # fmt: skip


def from_json(doc: Any, where: str = "") -> Any:
    """The value ``to_json`` encoded; ``CheckpointError`` naming ``where`` if malformed."""
    if isinstance(doc, list):
        return [from_json(v, f"{where}[{i}]") for i, v in enumerate(doc)]
    if not isinstance(doc, dict):
        return doc
    if TAG not in doc:
        return {k: from_json(v, f"{where}.{k}") for k, v in doc.items()}
    try:
        return _tagged(doc, where)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - untrusted input: any shape error is damage
        raise CheckpointError(
            f"the trainer state at {where or '(top)'} is malformed ({type(exc).__name__}: "
            f"{str(exc)[:200]})"
        ) from None


def _tagged(doc: dict[str, Any], where: str) -> Any:
    kind = doc[TAG]
    if kind == "tuple":
        return tuple(from_json(v, f"{where}[{i}]") for i, v in enumerate(doc["items"]))
    if kind == "dict":
        return {from_json(k, where): from_json(v, f"{where}.{k}") for k, v in doc["items"]}
    if kind == "tensor":
        dtype = getattr(torch, str(doc["dtype"]))
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{doc['dtype']!r} is not a dtype")
        raw = bytearray(base64.b64decode(doc["data"], validate=True))
        flat = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        return flat.reshape([int(n) for n in doc["shape"]]).clone()
    if kind == "pickle":
        raw = base64.b64decode(doc["data"], validate=True)
        try:
            return torch.load(io.BytesIO(raw), weights_only=True)
        except Exception as exc:  # noqa: BLE001
            raise CheckpointError(
                f"the trainer state at {where or '(top)'} is a {doc.get('type')} that only "
                f"an unrestricted unpickler could load ({type(exc).__name__}); it is not "
                "loaded. Keep such values out of the trainer's state (hyperparameters: plain "
                "values), or resume without it"
            ) from None
    if kind == "unsaved":
        return None
    raise ValueError(f"unknown tag {kind!r}")


class TrainerMeta:
    """A checkpoint state holding a trainer's own state: ``get()`` returns it when a save
    stages, ``put(value)`` receives it when a restore applies it. ``extra``: a second
    JSON dict saved beside it (the integration's own bookkeeping), through ``get_extra`` /
    ``put_extra``."""

    def __init__(
        self,
        get: Callable[[], dict[str, Any]],
        put: Callable[[dict[str, Any]], None],
        get_extra: Callable[[], dict[str, Any]] = dict,
        put_extra: Callable[[dict[str, Any]], None] = lambda _d: None,
    ) -> None:
        self._get, self._put = get, put
        self._get_extra, self._put_extra = get_extra, put_extra

    def state_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "state": to_json(self._get()), "extra": self._get_extra()}

    def check_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Decode without applying: a restore refuses it before any tensor is loaded."""
        self._decode(state_dict)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state, extra = self._decode(state_dict)
        self._put_extra(extra)
        self._put(state)

    @staticmethod
    def _decode(state_dict: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        if not isinstance(state_dict, dict) or state_dict.get("format") != FORMAT:
            got = state_dict.get("format") if isinstance(state_dict, dict) else state_dict
            raise CheckpointError(
                f"the trainer state has format {got!r}, this steadytrain reads {FORMAT}"
            )
        state = from_json(state_dict.get("state"), "state")
        extra = state_dict.get("extra") or {}
        if not isinstance(state, dict) or not isinstance(extra, dict):
            raise CheckpointError("the trainer state is not a dict")
        return state, extra


class LoaderPosition:
    """A checkpoint state for a ``TokenLoader`` read by a trainer through its dataset face
    (``loader.as_dataset()``): the position as of the last micro-batch the trainer reported
    trained on (``TokenIterableDataset.consumed``), so a trainer fetching ahead resumes at
    the first batch it fetched but did not train on. ``on_load()`` runs after a load."""

    def __init__(self, dataset: Any, on_load: Callable[[], None] = lambda: None) -> None:
        self.dataset, self._on_load = dataset, on_load

    def state_dict(self) -> dict[str, Any]:
        return self.dataset.consumed_state_dict()

    def check_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.dataset.loader.check_state_dict(state_dict)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state_dict)
        self._on_load()

    @property
    def resume_changes(self) -> list[dict[str, Any]]:
        return list(getattr(self.dataset.loader, "resume_changes", None) or [])
