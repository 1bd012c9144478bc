"""``exact_ddp(ddp)``: DDP reduces every step in one gradient layout, in every attempt, so a
resumed run equals an uninterrupted one bit for bit on any number of ranks.

    ddp = exact_ddp(DistributedDataParallel(model))   # every rank, before the first backward

Why (issue 40; ``bench/ddp_resume_layout.py`` shows it): DDP reduces a process's first
backward in its initial bucket layout (torch 2.13: every parameter in one bucket, in
registration order) and then rebuilds its buckets in the order the gradients became ready
(``Reducer::rebuild_buckets``; for a GPT, the reverse). An all-reduce over 3 or more ranks
sums an element in an order that depends on where it lies in its bucket (gloo's ring starts
each chunk's sum at another rank; NCCL is not measured here), so the same gradients reduced
in the two layouts differ in the last bit. An uninterrupted run reduces step 1 in the
initial layout and every later step in the rebuilt one; an attempt restored at step k
reduces step k+1 in the initial layout, and from there on its weights differ by an ULP or
so. Two ranks are immune (``a + b == b + a``), and so is a DDP that never rebuilds
(``find_unused_parameters=True`` without ``static_graph``: left as it is).

What it does: a DDP communication hook that, until DDP has rebuilt its buckets, reduces each
gradient as the rebuilt buckets will. Hooks after each gradient's accumulation record the
order the gradients became ready in this backward; rank 0's order is broadcast (DDP's
rebuild takes rank 0's too, so every rank reduces the same layout); DDP's own private
bucket assignment (fenced, with the other private names this needs, in
``checkpoint/torch_private.py``) groups it with DDP's bucket caps, as the rebuild will; each such bucket is gathered from DDP's buffer, all-reduced and
written back. Once DDP has rebuilt, the hook is a plain all-reduce with DDP's own
arithmetic (scale by 1/world, then sum: the same bits as DDP without a hook), and on the
first rebuilt step it checks that DDP's buckets are the ones it emulated; if not it warns
once (exactness is then not promised) and training goes on, as it does when the emulation
cannot be set up.

It assumes what DDP's one-time rebuild assumes: gradients become ready in the same order in
every step. Cost: the step before the rebuild (one per attempt) copies the gradients twice
more and runs a Python hook per parameter; later steps, one Python call per bucket and a
scale pass over the gradients that DDP otherwise fuses into its copy.
"""

from __future__ import annotations

import itertools
import os
import warnings

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from steadytrain.checkpoint import torch_private as tp

__all__ = ["exact_ddp"]

Future = torch.futures.Future


def exact_ddp(ddp: DistributedDataParallel) -> DistributedDataParallel:
    """Give ``ddp`` the layout-keeping reduction (module docstring) and return it.

    Call it on every rank, before the first backward. A DDP that already has a
    communication hook (DDP's own mixed precision registers one) keeps it, with a warning
    that a resumed run on 3 or more ranks may then differ in the last bits."""
    if not isinstance(ddp, DistributedDataParallel):
        raise TypeError(
            f"exact_ddp takes a torch DistributedDataParallel module, not {type(ddp).__name__}"
        )
    if getattr(ddp, "_steadytrain_exact", False):
        return ddp
    if ddp.find_unused_parameters and not ddp.static_graph:
        return ddp  # DDP never rebuilds its buckets then: one layout already
    if tp.ddp_hooks(ddp):
        _warn("the module already has a communication hook, left in place")
        return ddp
    if tp.ddp_has_rebuilt(ddp) is None:
        _warn("this torch's DDP does not say when it rebuilds its buckets")
        return ddp
    try:
        tp.check_ddp()
    except tp.TorchAPIError as e:
        _warn(f"this torch cannot work out DDP's bucket layout ({e})")
        return ddp
    ddp.register_comm_hook(_LayoutKeeper(ddp), _hook)
    ddp._steadytrain_exact = True
    return ddp


def _hook(state, bucket):  # noqa: ANN001, ANN202 (DDP refuses the annotations it cannot read)
    return state.reduce(bucket)


def _warn(why: str) -> None:
    warnings.warn(
        f"steadytrain.exact_ddp: {why}; a resumed run on 3 or more ranks may differ from an "
        "uninterrupted one in the last bits of its weights",
        RuntimeWarning,
        stacklevel=3,
    )


class _LayoutKeeper:
    """The hook's state: when each gradient was ready, and the layout it emulated."""

    def __init__(self, ddp: DistributedDataParallel) -> None:
        self.ddp = ddp
        self.group = ddp.process_group
        self.scale = 1.0 / self.group.size()
        self.ready: dict[int, int] = {}  # id(parameter) -> when its gradient was ready
        self.clock = itertools.count()
        self.handles = [
            p.register_post_accumulate_grad_hook(self._ready)
            for p in ddp.module.parameters()
            if p.requires_grad
        ]
        self.pending: list[tuple[dist.GradBucket, Future[torch.Tensor]]] = []
        self.emulated: list[list[torch.Tensor]] | None = None  # the buckets, as parameters
        self.checked = False

    def _ready(self, param: torch.Tensor) -> None:
        self.ready[id(param)] = next(self.clock)  # the last backward's time wins

    def reduce(self, bucket: dist.GradBucket) -> Future[torch.Tensor]:
        if tp.ddp_has_rebuilt(self.ddp):
            if not self.checked:
                self._check(bucket)
            return self._all_reduce(bucket.buffer())
        done: Future[torch.Tensor] = Future()
        self.pending.append((bucket, done))
        if bucket.is_last():  # DDP launches its buckets in order: every gradient is ready
            pending, self.pending = self.pending, []
            self._reduce_as_rebuilt([b for b, _ in pending])
            for b, fut in pending:
                fut.set_result(b.buffer())
        return done

    def _all_reduce(self, flat: torch.Tensor) -> Future[torch.Tensor]:
        flat.mul_(self.scale)  # what DDP does without a hook: grad * (1 / world), then sum
        work = dist.all_reduce(flat, group=self.group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    def _reduce_as_rebuilt(self, buckets: list[dist.GradBucket]) -> None:
        """All-reduce the initial buckets' gradients grouped as DDP's rebuild will group
        them, the sums written back into DDP's buffers."""
        params: list[torch.Tensor] = []
        segments: list[torch.Tensor] = []  # each gradient's memory in its bucket's buffer
        for bucket in buckets:
            flat = bucket.buffer()
            base, size = flat.data_ptr(), flat.element_size()
            for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
                params.append(param)
                segments.append(flat.narrow(0, (grad.data_ptr() - base) // size, grad.numel()))
        layout = self._layout(params)
        if layout is None:  # as DDP's initial buckets: a sum all the same, not the exact one
            for bucket in buckets:
                self._all_reduce(bucket.buffer()).wait()
            return
        self.emulated = [[params[i] for i in members] for members in layout]
        for members in layout:
            parts = [segments[i] for i in members]
            flat = torch.cat(parts)
            self._all_reduce(flat).wait()
            offset = 0
            for part in parts:
                part.copy_(flat.narrow(0, offset, part.numel()))
                offset += part.numel()

    def _layout(self, params: list[torch.Tensor]) -> list[list[int]] | None:
        """Positions in ``params`` of each bucket DDP's rebuild will make (rank 0's ready
        order, DDP's caps), or None where that cannot be worked out (warned)."""
        n = len(params)
        known = all(id(p) in self.ready for p in params)
        order = sorted(range(n), key=lambda i: self.ready.get(id(params[i]), i))
        # On the parameters' device: NCCL broadcasts only CUDA tensors.
        agreed = torch.tensor(order if known else [-1] * n, device=params[0].device)
        dist.broadcast(agreed, src=dist.get_global_rank(self.group, 0), group=self.group)
        order = agreed.tolist()
        try:
            if order[0] < 0:
                raise ValueError("rank 0 saw a gradient ready without its hook")
            if os.environ.get("DDP_SET_LAST_BUCKET_CAP") == "1":  # read by the rebuild too
                buckets, _ = _assign(params, order[::-1], tp.ddp_rebuild_limits(self.ddp))
                return buckets[::-1]
            return _assign(params, order, tp.ddp_rebuild_limits(self.ddp))[0]
        except Exception as e:  # do no harm: the plain all-reduce, with a warning
            _warn(f"the rebuilt gradient layout could not be worked out ({e})")
            self.checked = True
            return None

    def _check(self, bucket: dist.GradBucket) -> None:
        """DDP's rebuilt bucket ``bucket.index()`` is the one emulated, member for member;
        the hooks that timed the gradients go once every bucket was seen."""
        want = self.emulated or []
        got = bucket.parameters()
        i = bucket.index()
        same = i < len(want) and len(want[i]) == len(got)
        same = same and all(a is b for a, b in zip(want[i], got, strict=True))
        if not same or (bucket.is_last() and i + 1 != len(want)):
            if self.emulated is not None:
                _warn("DDP rebuilt its gradient buckets unlike the layout emulated before")
            self.checked = True
        if bucket.is_last():
            self.checked = True
        if self.checked:
            for handle in self.handles:
                handle.remove()
            self.handles, self.ready = [], {}


def _assign(
    params: list[torch.Tensor], order: list[int], limits: list[int]
) -> tuple[list[list[int]], list[int]]:
    """DDP's own bucket assignment of ``params`` taken in ``order`` (positions in params)."""
    buckets, caps = tp.ddp_bucket_assignment([params[i] for i in order], limits)
    return [[order[i] for i in bucket] for bucket in buckets], caps
