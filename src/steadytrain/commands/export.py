"""``steadytrain export CKPT --to dcp|torch|safetensors --out DEST [--json]``."""

from __future__ import annotations

import argparse
import sys
import time

HELP = "export a checkpoint for stock tools: plain DCP, one torch.save file, or safetensors"
DESCRIPTION = (
    "Export one checkpoint so that tools without steadytrain read it. CKPT is a checkpoint "
    "directory (step-NNNNNNNN) or a checkpoint root, which means its newest committed "
    "checkpoint that verifies. The checkpoint is verified first (COMMIT, every file's size "
    "and checksum): a damaged one is never exported (exit 2, named). "
    "--to dcp: a DCP checkpoint directory without steadytrain's raw tensor records, read by "
    "torch.distributed.checkpoint.load and format_utils.dcp_to_torch_save; it holds every "
    "tensor and non-tensor item, plus the JSON states and RNG under the key '_steadytrain'. "
    "--to torch: one torch.save file, what dcp_to_torch_save gives for that directory. "
    "--to safetensors: one module state (--state, default 'model') as model.safetensors "
    "keyed by the module's own state_dict() keys, for Hugging Face from_pretrained with your "
    "config.json beside it; DEST is a directory, or a file when it ends in .safetensors. "
    "DEST must not exist: it is written under a temporary name and renamed into place, never "
    "over anything (not even an empty directory made meanwhile); a failed, SIGTERMed or "
    "interrupted export removes its temporary, and the next export to DEST removes one that "
    "a SIGKILLed export on this host left. "
    "Example: steadytrain export ckpts/ --to dcp --out ckpts-dcp, then in any PyTorch: "
    "dcp_to_torch_save('ckpts-dcp', 'all.pt'). More: docs/checkpoint.md, 'Reading "
    "checkpoints with other tools'."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory or checkpoint root")
    p.add_argument(
        "--to", required=True, choices=["dcp", "torch", "safetensors"], help="output format"
    )
    p.add_argument(
        "--out", required=True, metavar="DEST", help="new path to write (never replaced)"
    )
    p.add_argument(
        "--state",
        default=None,
        metavar="NAME",
        help="safetensors: the module state to write (default: 'model', or the only one)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


class _Progress:
    """Progress on stderr for work that takes a while: for a phase of 64 MiB or more, a
    line at most every 2 s, from 2 s after the work started."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.t0: float | None = None
        self.last = 0.0

    def __call__(self, phase: str, done: int, total: int) -> None:
        now = time.monotonic()
        if self.t0 is None:
            self.t0 = self.last = now
        if self.quiet or total < 64 << 20 or now - self.last < 2.0:  # small: soon done
            return
        self.last = now
        pct = 100.0 * done / total if total else 100.0
        print(
            f"steadytrain export: {phase} {pct:.0f}% ({done / 2**20:.0f} of "
            f"{total / 2**20:.0f} MiB, {now - self.t0:.0f} s)",
            file=sys.stderr,
            flush=True,
        )


def run(args: argparse.Namespace) -> int:
    from steadytrain.checkpoint.export import export_checkpoint

    result = export_checkpoint(
        args.checkpoint,
        args.to,
        args.out,
        state=args.state,
        progress=_Progress(args.quiet or args.json),
    )
    for s in result["skipped"]:
        print(f"steadytrain export: skipped {s['path']}: {s['reason']}", file=sys.stderr)
    if args.json:
        from steadytrain.commands._util import print_json

        print_json(result)
        return 0
    print(
        f"exported step {result['step']} of {result['source']} as {result['to']} to "
        f"{result['out']} ({result['bytes'] / 2**20:.1f} MiB, {result['tensors']} tensors, "
        f"{result['seconds']:.1f} s)"
    )
    if result["skipped_keys"]:
        print(f"not in safetensors (not tensors): {', '.join(result['skipped_keys'])}")
    return 0
