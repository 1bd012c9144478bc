"""``steadytrain checkpoints DIR [--json]``: committed and partial checkpoints, newest first."""

from __future__ import annotations

import argparse

HELP = "list committed, partial and damaged checkpoints, newest first"
DESCRIPTION = (
    "List checkpoints under DIR (a local path or a URL) with step, size, age "
    "and whether each verifies against its COMMIT manifest (sizes and checksums). "
    "A COMMIT that fails its own checks (malformed, or its commit_checksum does not match) "
    "is listed as 'damaged' with the reason; restore skips such checkpoints. Only regular "
    "files are read: a FIFO, a device or a link leaving DIR in a checkpoint makes it fail "
    "verification, named (listing an untrusted directory never hangs). Exit status: 0 when "
    "every committed checkpoint is sound, 2 when any is damaged or does not verify (sizes, "
    "checksums), after the full list, naming them on stderr."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", metavar="DIR")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--no-checksums", action="store_true", help="check sizes only (faster on big runs)"
    )


def run(args: argparse.Namespace) -> int:
    from steadytrain.checkpoint.inspect import list_checkpoints

    rows = list_checkpoints(args.directory, checksums=not args.no_checksums)
    if args.json:
        from steadytrain.commands._util import print_json

        print_json({"directory": args.directory, "checkpoints": rows})
        return _damaged_status(args.directory, rows)
    if not rows:
        print(f"no checkpoints in {args.directory}")
        return 0
    print(f"{'name':<22} {'step':>9} {'state':<10} {'size':>10} {'age':>8}  verifies")
    for r in rows:
        size = f"{r['size_bytes'] / 2**20:.1f}M" if r["size_bytes"] else "-"
        age = _age(r["age_s"])
        ver = "yes" if r["verifies"] else f"no: {r['error']}"
        print(f"{r['name']:<22} {r['step']:>9} {r['state']:<10} {size:>10} {age:>8}  {ver}")
    return _damaged_status(args.directory, rows)


def _damaged_status(directory: str, rows: list[dict]) -> int:
    """2 (and one line on stderr per kind, naming them) when any checkpoint's COMMIT is
    damaged or a committed checkpoint does not verify: a script that lists before resuming
    must not mistake a damaged root for a sound one."""
    import sys

    damaged = [r["name"] for r in rows if r["state"] == "damaged"]
    failed = [r["name"] for r in rows if r["state"] == "committed" and not r["verifies"]]
    if damaged:
        print(
            f"steadytrain checkpoints: error: {len(damaged)} damaged checkpoint(s) in "
            f"{directory}: {', '.join(damaged)}; restore skips them and uses the newest one "
            "that verifies; see the reasons above",
            file=sys.stderr,
        )
    if failed:
        print(
            f"steadytrain checkpoints: error: {len(failed)} committed checkpoint(s) in "
            f"{directory} do not verify: {', '.join(failed)}; restore skips them and uses the "
            "newest one that verifies. Copy intact ones back from a remote or backup copy, "
            "or remove them; see the reasons above",
            file=sys.stderr,
        )
    return 2 if damaged or failed else 0


def _age(s: float) -> str:
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s / n:.1f}{unit}"
    return f"{max(s, 0):.0f}s"
