"""``steadytrain export --to safetensors``: one module state as ``model.safetensors``.

The keys are the module's own ``state_dict()`` keys: the checkpoint's FQN is
``<state name>.<key>`` (``Checkpointer`` saves ``get_model_state_dict(module)`` under the
state's name), and DCP's ``planner_data`` records the split exactly, so the state's name is
removed and nothing else (a Hugging Face ``LlamaForCausalLM`` keeps ``model.layers.0...`` and
``lm_head.weight``, the names ``from_pretrained`` expects). Only the chosen state's tensors
are read (``dcp.load`` of a template built from ``.metadata``), never the optimizer's.
"""

from __future__ import annotations

import os
from typing import Any

from steadytrain.errors import CheckpointError

__all__ = ["SAFETENSORS_NAME", "need_safetensors", "pick_state", "write_safetensors"]

SAFETENSORS_NAME = "model.safetensors"
_MISSING = (
    "--to safetensors needs the safetensors package: pip install 'steadytrain[export]' "
    "(or pip install safetensors)"
)


def need_safetensors() -> None:
    """CheckpointError naming the extra when ``safetensors`` is not installed."""
    try:
        import safetensors  # noqa: F401 - only whether it is there (no torch imported)
    except ImportError:
        raise CheckpointError(_MISSING) from None


def _module_states(metadata: Any) -> dict[str, dict[str, str]]:
    """``{state name: {state_dict key: checkpoint fqn}}`` for each state whose entries are
    all one level deep (a module's state dict; an optimizer's nests ``state``/``param_groups``)."""
    out: dict[str, dict[str, str]] = {}
    nested: set[str] = set()
    planner = metadata.planner_data or {}
    for fqn in metadata.state_dict_metadata:
        path = planner.get(fqn) or tuple(fqn.split(".", 1))
        if len(path) != 2 or not all(isinstance(p, str) for p in path):
            nested.add(str(path[0]))
            continue
        out.setdefault(path[0], {})[path[1]] = fqn
    return {name: keys for name, keys in out.items() if name not in nested}


def pick_state(src: str, manifest: dict[str, Any], metadata: Any, state: str | None) -> str:
    """The module state to export: ``state``, else ``model``, else the only module state;
    CheckpointError naming the module states when there is no such choice."""
    modules = _module_states(metadata)
    if state is None:
        if "model" in modules or len(modules) != 1:
            state = "model"
        else:
            state = next(iter(modules))
    if state not in modules:
        raise CheckpointError(
            f"{src}: --state {state!r} is not a module state of this checkpoint "
            f"(module states: {', '.join(sorted(modules)) or 'none'}; all states: "
            f"{', '.join(manifest['states'])}); pick one with --state"
        )
    return state


def write_safetensors(
    src: str, manifest: dict[str, Any], metadata: Any, state: str | None, tmp: str, dest: str
) -> tuple[int, list[str]]:
    """Write ``state`` (default ``model``, or the only module state) of the verified
    checkpoint ``src`` as ``tmp/model.safetensors``, or as ``dest`` when that ends in
    ``.safetensors``; (tensors written, non-tensor keys left out)."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise CheckpointError(_MISSING) from None
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from steadytrain.checkpoint.raw_records import ShardReader

    state = pick_state(src, manifest, metadata, state)
    modules = _module_states(metadata)
    template, skipped = {}, []
    for key, fqn in modules[state].items():
        md = metadata.state_dict_metadata[fqn]
        if isinstance(md, TensorStorageMetadata):
            template[fqn] = torch.empty(md.size, dtype=md.properties.dtype)
        else:
            skipped.append(key)
    # Verified above; ShardReader is DCP's FileSystemReader plus raw records.
    dcp.load(template, storage_reader=ShardReader(src), no_dist=True)
    tensors = {key: template[fqn] for key, fqn in modules[state].items() if fqn in template}
    os.makedirs(tmp)
    tmp_file = os.path.join(tmp, SAFETENSORS_NAME)
    save_file(tensors, tmp_file, metadata={"format": "pt"})
    # safetensors writes its file 0600 whatever the umask; every other export file is
    # created 0666 less the umask, and so is this one now: the mode of ``tmp`` (made 0777
    # less the umask) without its execute bits. Not os.umask(): setting it to read it would
    # change it for every thread of the process meanwhile.
    os.chmod(tmp_file, os.stat(tmp).st_mode & 0o666)
    if dest.endswith(".safetensors"):
        from steadytrain.checkpoint.export import publish_new_file

        publish_new_file(tmp_file, dest)
    else:
        with open(tmp_file, "rb") as f:
            os.fsync(f.fileno())
    return len(tensors), sorted(skipped)
