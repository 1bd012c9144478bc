"""Who keeps whose copy, and the transfers on the tier's own gloo group.

Pairing (``pair``): nodes sorted by their lowest rank; node n's i-th rank (by rank order)
sends its copy to node (n+1) % N's (i % count)-th rank. A rank keeps the copies of every
rank whose peer it is (usually one). One node: nobody has a peer (a node loss then falls
back to durable checkpoints).

Transfers are point-to-point on the side group (never the training group), each posted
non-blocking and then waited for together: in a ring every rank sends and receives, and a
blocking send first would deadlock. Sizes go first (an int64; -1: nothing this time), then
a uint8 tensor of the file's bytes.

Sizes are agreed before any byte moves (the generation's all-gather; at restore, the plan),
and gloo cannot survive a message longer than the buffer posted for it (the receiving
process aborts). So the bytes on the wire are always exactly the agreed size, decided on
both ends from what both know: a sender whose image is not its agreed size announces that
size and sends no data; a receiver allocates nothing for an announced size that is not the
agreed one, posts no receive for it, and reports a refused copy (``Refused``). At restore
(``Transfer``) a holder whose file changed since the scan sends zeros of the planned size,
which the owner's checksum refuses.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

__all__ = ["Pairing", "pair", "exchange", "Transfer"]

_TAG_SIZE, _TAG_DATA = 7301, 7302


@dataclasses.dataclass
class Pairing:
    nodes: list[str]  # node of each rank
    peer_of: list[int | None]  # the rank that keeps each rank's copy (None: no peer)

    def holds_for(self, rank: int) -> list[int]:
        """The owners whose copies ``rank`` keeps."""
        return [o for o, p in enumerate(self.peer_of) if p == rank]


def pair(nodes: list[str], enabled: bool = True) -> Pairing:
    """The pairing for ranks on ``nodes`` (``nodes[r]``: rank r's node)."""
    members: dict[str, list[int]] = {}
    for r, n in enumerate(nodes):
        members.setdefault(n, []).append(r)
    order = sorted(members, key=lambda n: members[n][0])
    peer_of: list[int | None] = [None] * len(nodes)
    if enabled and len(order) > 1:
        for idx, n in enumerate(order):
            nxt = members[order[(idx + 1) % len(order)]]
            for i, r in enumerate(members[n]):
                peer_of[r] = nxt[i % len(nxt)]
    return Pairing(nodes=list(nodes), peer_of=peer_of)


def _readable(image: np.ndarray) -> torch.Tensor:
    """A tensor over ``image``, which may be a read-only mapping: a send only reads it
    (torch warns that writing a read-only array's tensor is undefined; nothing writes)."""
    if image.flags.writeable:
        return torch.from_numpy(image)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(image)


def _wait(works: list[Any]) -> None:
    for w in works:
        w.wait()


def exchange(
    pg: Any,
    peer: int | None,
    image: np.ndarray | None,
    owners: list[int],
    into: Callable[[int, int], np.ndarray] | None = None,
    sizes: list[int] | None = None,
    problems: list[str] | None = None,
) -> dict[int, np.ndarray]:
    """Send this rank's file image to ``peer`` and receive the images of ``owners``.

    Every rank calls it in the same generation; ``image`` None sends "nothing" (-1), and
    an owner that sent nothing is missing from the result. ``into(owner, nbytes)`` gives
    the array a copy is received into (the tier: its file, mapped); default a new one.
    ``sizes[r]``: rank r's image size as agreed (the all-gather); an image or an announced
    size that differs from it moves no byte, and the refusal goes to ``problems``."""
    import torch.distributed as dist

    me = dist.get_rank(pg)
    problems = problems if problems is not None else []
    out_size = torch.tensor([-1 if image is None else len(image)], dtype=torch.int64)
    in_sizes = {o: torch.zeros(1, dtype=torch.int64) for o in owners}
    works = []
    if peer is not None:
        works.append(dist.isend(out_size, dst=peer, group=pg, tag=_TAG_SIZE))
    for o, t in in_sizes.items():
        works.append(dist.irecv(t, src=o, group=pg, tag=_TAG_SIZE))
    _wait(works)
    send = peer is not None and image is not None
    if send and sizes is not None and len(image) != sizes[me]:
        send = False  # the receiver refuses it too: it knows the agreed size
        problems.append(
            f"rank {me}: its copy is {len(image)} bytes, {sizes[me]} were agreed: not sent"
        )
    works, bufs = [], {}
    if send:
        works.append(dist.isend(torch.from_numpy(image), dst=peer, group=pg, tag=_TAG_DATA))
    for o, t in in_sizes.items():
        n = int(t.item())
        if n >= 0 and sizes is not None and n != sizes[o]:
            problems.append(
                f"rank {me}: rank {o} announced a copy of {n} bytes, {sizes[o]} were agreed: "
                "refused (nothing allocated or received)"
            )
        elif n >= 0:
            bufs[o] = np.empty(n, dtype=np.uint8) if into is None else into(o, n)
            works.append(dist.irecv(torch.from_numpy(bufs[o]), src=o, group=pg, tag=_TAG_DATA))
    _wait(works)
    return bufs


class Transfer:
    """Restore's transfers, posted at once: send each ``(dst, image, nbytes)``, receive
    ``(src, nbytes)`` (sizes are known from the agreed plan) into fresh memory mapped
    before the transfer; ``wait()`` for all of them, then ``received`` holds the copy. An
    image that is not its planned ``nbytes`` (the file changed since the scan) is sent as
    zeros of that size, which the owner's checksum refuses; ``problems`` says why."""

    def __init__(
        self, pg: Any, sends: list[tuple[int, np.ndarray, int]], recv: tuple[int, int] | None
    ) -> None:
        import torch.distributed as dist

        from steadytrain.checkpoint.memory.snapshot import anonymous

        self._works, self.received, self.problems = [], None, []
        self._images = []  # alive until the sends are done
        for dst, image, nbytes in sends:
            if len(image) != nbytes:  # more would abort the receiver (gloo), less pass as whole
                self.problems.append(
                    f"the copy for rank {dst} is {len(image)} bytes, {nbytes} were planned (it "
                    "changed since the scan): zeros sent, so that copy is refused"
                )
                image = np.zeros(nbytes, dtype=np.uint8)
            self._images.append(image)
            self._works.append(dist.isend(_readable(image), dst=dst, group=pg, tag=_TAG_DATA))
        if recv is not None:
            self.received = anonymous(recv[1])
            buf = torch.from_numpy(self.received)
            self._works.append(dist.irecv(buf, src=recv[0], group=pg, tag=_TAG_DATA))

    def wait(self) -> None:
        works, self._works = self._works, []
        _wait(works)
        self._images = []
