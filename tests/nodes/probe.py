"""Run on a node by the harness tests: can it reach its object-store link and the rendezvous
store? Prints one JSON object: ``s3`` (the HTTP status, or the error), ``s3_s`` (seconds
for that request), ``rdzv`` ("ok" or the error), ``routes`` (``ip route`` lines here)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request


def main() -> None:
    timeout = float(sys.argv[1]) if len(sys.argv) > 1 else 10.0
    out: dict[str, object] = {"node": os.environ["STEADYTRAIN_NODE"]}
    t = time.monotonic()
    try:
        urllib.request.urlopen(os.environ["STEADYTRAIN_S3_ENDPOINT"] + "/", timeout=timeout)
        out["s3"] = 200
    except urllib.error.HTTPError as e:
        out["s3"] = e.code  # 403 without credentials: the S3 gateway answered
    except OSError as e:
        out["s3"] = f"error: {e}"
    out["s3_s"] = time.monotonic() - t
    host, port = os.environ["RDZV"].rsplit(":", 1)
    try:  # a TCP connection to the c10d store's port (no torch import: seconds on 2 cores)
        socket.create_connection((host, int(port)), timeout=timeout).close()
        out["rdzv"] = "ok"
    except OSError as e:
        out["rdzv"] = f"error: {e}"
    r = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True)
    out["routes"] = r.stdout.strip().splitlines()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
