"""A slow network link on loopback: a TCP proxy that adds latency and caps bandwidth.

Benchmarks and fault tests put it between a client and the SeaweedFS server to imitate a
far-away object store. Each direction is one shared link: a chunk starts transmitting when
the link is free, occupies it for ``len / bandwidth`` seconds and arrives ``latency_s``
later, so concurrent connections share the bandwidth as they would on a real wire.
Runs its own asyncio loop in a daemon thread; ``close()`` stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

__all__ = ["SlowLink"]

_CHUNK = 64 << 10


class _Wire:
    def __init__(self, bandwidth: float | None, latency: float) -> None:
        self.bandwidth = bandwidth
        self.latency = latency
        self.next_free = 0.0
        self.bytes = 0

    def schedule(self, n: int) -> float:
        now = time.monotonic()
        start = max(now, self.next_free)
        self.next_free = start + (n / self.bandwidth if self.bandwidth else 0.0)
        self.bytes += n
        return self.next_free + self.latency


class SlowLink:
    """``SlowLink(port_of_server, latency_s=0.02, down_bps=50e6)``; connect to ``.port``."""

    def __init__(
        self,
        target_port: int,
        *,
        latency_s: float = 0.0,
        down_bps: float | None = None,
        up_bps: float | None = None,
        target_host: str = "127.0.0.1",
        listen_host: str = "127.0.0.1",
    ) -> None:
        self.target = (target_host, target_port)
        self.listen_host = listen_host  # the node harness listens on its bridge address
        self.down = _Wire(down_bps, latency_s)
        self.up = _Wire(up_bps, latency_s)
        self.connections = 0
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.AbstractServer | None = None
        ready = threading.Event()
        self._thread = threading.Thread(target=self._main, args=(ready,), daemon=True)
        self._thread.start()
        ready.wait()
        assert self._server is not None
        self.port: int = self._server.sockets[0].getsockname()[1]

    @property
    def endpoint(self) -> str:
        return f"http://{self.listen_host}:{self.port}"

    def _main(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, self.listen_host, 0)
        )
        ready.set()
        self._loop.run_forever()

    async def _handle(self, client_r, client_w) -> None:
        self.connections += 1
        try:
            server_r, server_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.close()
            return
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(
                self._pump(client_r, server_w, self.up), self._pump(server_r, client_w, self.down)
            )

    async def _pump(self, reader, writer, wire: _Wire) -> None:
        queue: asyncio.Queue = asyncio.Queue(maxsize=64)

        async def deliver() -> None:
            while (item := await queue.get()) is not None:
                at, data = item
                delay = at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                writer.write(data)
                await writer.drain()

        task = asyncio.ensure_future(deliver())
        try:
            while data := await reader.read(_CHUNK):
                await queue.put((wire.schedule(len(data)), data))
                if task.done():
                    break
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                if not task.done():
                    await queue.put(None)
                await task
            with contextlib.suppress(Exception):
                writer.close()

    def close(self) -> None:
        async def _stop() -> None:
            if self._server is not None:
                self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(RuntimeError):
            asyncio.run_coroutine_threadsafe(_stop(), self._loop).result(timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def __enter__(self) -> SlowLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _serve_forever() -> None:
    """``python -m steadytrain.testing.slowlink PORT LATENCY_MS DOWN_MBPS``: run a link in
    its own process (so its CPU time is not the measured process's), print its port, and
    serve until stdin closes."""
    import sys

    target, latency_ms, down_mbps = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
    link = SlowLink(target, latency_s=latency_ms / 1000, down_bps=down_mbps * 1e6 or None)
    print(link.port, flush=True)
    sys.stdin.read()
    link.close()


if __name__ == "__main__":
    _serve_forever()
