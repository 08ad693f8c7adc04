"""A loopback world: one process plays rank r of an N-rank job in which every peer is a copy of it.

``launch.simulate_world=N`` runs train.py as rank ``launch.simulate_rank`` of N under this process group: the meshes,
DTensor placements, FSDP and expert-FSDP shards, dispatcher splits and prefetch chains are the real job's, and so is
every tensor this rank computes but the experts' gradients (below), for a real job whose ranks all read the same
batch and hold equal shards (each sharded tensor tiled from this rank's shard). Each collective returns what that
job's collective would return here:

- all-gather: N copies of the local input (the tiled tensor);
- reduce-scatter: this rank's chunk of the input, times N (sum) or once (average);
- all-reduce: the input times N (sum), unchanged (average, max, min);
- all-to-all: what was sent: peer j returns chunk j. Each rank receives exactly the rows it sends (the
  balanced-routing case, whatever the router chose), and its experts, standing in for the experts at the same
  position on every peer, compute what those peers compute for this rank's rows. So everything that flows through
  the all-to-all is exact (the loss, every activation and its gradient, the non-expert gradients); an expert's
  gradient sums the rows of every peer's expert at its position (the mean over the ep group of the real job's
  gradients there), not the rows of this rank's own experts alone.
- broadcast, barrier: local.

Each collective runs inside a profiler range named ``loopback <collective>`` so that a profile counts it apart
from compute. What is sent is counted per collective kind and group (``COUNTED``): bytes of each call's input, as the
planner counts. Point-to-point sends and receives (no layout of this project uses them) are refused by name.

Links (``launch.links``, ``parallelisms/links.py``). Off (the default, and the exact-value tests'), a collective is
its copies, on the stream the caller is on (FSDP's all-gather stream, say), done when the call returns. With
``launch.links.emulate`` each collective runs where NCCL runs it and takes the time the real one takes on the links:

- on its process group's own stream (NCCL runs each communicator's collectives on an internal stream), which first
  waits for the caller's stream; there ``kernels.comm.link``'s timer reads the device's clock, the copies run, and
  the timer holds the stream until the collective's link time has passed since that clock, in a kernel on
  ``launch.links.comm_sms`` SMs for an all-to-all, ``ring_sms`` for the rings (what NCCL's channels or DeepEP's SMs
  take from the compute beside them);
- the link time is ``parallelisms.links``'s for this call: its bytes per peer (an all-to-all's real splits), its
  group's ranks (inside a node or across nodes) and the rates of ``launch.links``;
- the caller waits as with NCCL: the returned work holds the stream's event, and its ``wait()`` makes the stream
  current at that moment wait on it, never the host. c10d waits at once for a synchronous call (so the caller's
  next kernels wait: an all-to-all with async_op=False, FSDP's all-gather on its own stream, which FSDP's event then
  hands to the compute), a functional collective at its tensor's first use (``wait_tensor``), an async one at
  ``work.wait()`` (domino's halves). ``HELD`` adds up the link seconds per collective kind and group.

On the CPU there is one stream: the caller sleeps for the link time after the copies (the timer's reference), so
nothing overlaps a collective there; the values are the same either way.
"""

from __future__ import annotations

import collections
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.futures import Future

from core import device
from core.torch_compat import group_ranks_named, premul_sum_factor, work_from_future
from kernels.comm.link import link_timer
from parallelisms.links import LinkConfig, all_to_all_seconds, ring_seconds

BACKEND = "loopback"
# Bytes of each collective's input by (kind, group name), summed over the process's calls (one rank's share).
COUNTED: collections.Counter = collections.Counter()
# Link seconds held by (kind, group name) under launch.links.emulate, summed over the process's calls.
HELD: collections.Counter = collections.Counter()
_LINKS = LinkConfig()  # the world's links: init_loopback_world's


def _done(result) -> dist.Work:
    future: Future = Future()
    future.set_result(result)
    return work_from_future(future)


class _LinkWork(dist.Work):
    """A collective in flight on its group's stream: ``wait()`` makes the current stream wait for it (NCCL's work)."""

    def __init__(self, result, event, module) -> None:
        super().__init__()
        self._result, self._event, self._module = result, event, module

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._module.current_stream().wait_event(self._event)
        return True

    def is_completed(self) -> bool:
        return self._event.query()

    def get_future(self) -> Future:
        future: Future = Future()
        future.set_result(self._result)
        return future

    def result(self):
        return self._result


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _scale(t: torch.Tensor, op, n: int) -> None:
    """``t`` reduced over n equal copies, in place."""
    kind = getattr(op, "op", op)  # a ReduceOp (PREMUL_SUM carries its factor) or its RedOpType
    R = dist.ReduceOp.RedOpType
    if kind == R.SUM:
        t.mul_(n)
    elif kind == R.PREMUL_SUM and (factor := premul_sum_factor(op)) is not None:  # a divide factor, as NCCL applies it
        t.mul_(factor * n)
    elif kind == R.PRODUCT:
        t.pow_(n)
    elif kind not in (R.AVG, R.MAX, R.MIN, R.BAND, R.BOR):
        raise NotImplementedError(f"the loopback world has no reduce op {kind} (a premultiplied sum only where torch "
                                  "gives its factor: FSDP's is forced to a sum and a divide, parallelisms/parallelize)")


class LoopbackGroup(dist.ProcessGroup):
    """One process group of the loopback world; ``rank`` is this process's rank in the group."""

    def __init__(self, rank: int, size: int, links: LinkConfig | None = None) -> None:
        super().__init__(rank, size)
        self._rank, self._size, self._name = rank, size, ""
        self._links = links or _LINKS
        self._ranks: list[int] | None = None  # the group's global ranks, read from c10d at the first timed call
        self._streams: dict[torch.device, object] = {}

    # -- what c10d asks of a backend
    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def getBackendName(self) -> str:  # noqa: N802 (c10d's names)
        return BACKEND

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._name = name

    def getGroupName(self) -> str:  # noqa: N802
        return self._name

    @property
    def group_name(self) -> str:
        return self._name

    def _count(self, kind: str, tensors) -> None:
        COUNTED[kind, self.group_name] += _nbytes(tensors)

    # -- the links
    def global_ranks(self) -> list[int]:
        """The group's ranks in the world, in group order (c10d's record of the group named like this backend)."""
        if self._ranks is None:
            self._ranks = (group_ranks_named(self._name) if self._size > 1 else None) or list(range(self._size))
        return self._ranks

    def _ring_seconds(self, kind: str, tensors) -> float:
        if not self._links.emulate or self._size == 1:
            return 0.0
        return ring_seconds(kind, _nbytes(tensors), self.global_ranks(), self._links)

    def _all_to_all_seconds(self, bytes_to: list[float]) -> float:
        if not self._links.emulate or self._size == 1:
            return 0.0
        return all_to_all_seconds(bytes_to, self.global_ranks(), self._rank, self._links)

    def _run(self, kind: str, tensors, result, copy, seconds: float) -> dist.Work:
        """Run ``copy`` (the collective's values) as collective ``kind`` on ``tensors`` (its inputs and outputs),
        holding its stream ``seconds`` (0: the copies alone, on the caller's stream) -> its work."""
        with torch.profiler.record_function(f"loopback {kind}"):
            if seconds <= 0:
                copy()
                return _done(result)
            HELD[kind, self.group_name] += seconds
            like, ns = tensors[0], round(seconds * 1e9)
            sms = self._links.comm_sms if kind == "all_to_all" else self._links.ring_sms
            timer = link_timer(like)
            if like.device.type == "cpu":  # one stream: the caller waits
                start = timer.clock(like)
                copy()
                timer.hold(start, ns, sms, like)
                return _done(result)
            module = device.module(like.device.type)
            stream = self._streams.get(like.device)
            if stream is None:
                stream = self._streams[like.device] = module.Stream(device=like.device)
            stream.wait_stream(module.current_stream(like.device))
            with module.stream(stream):
                start = timer.clock(like)
                copy()
                timer.hold(start, ns, sms, like)
                event = module.Event()
                event.record(stream)
            for t in tensors:  # the caching allocator must not hand their memory out before the stream is done
                t.record_stream(stream)
            return _LinkWork(result, event, module)

    # -- the collectives, as a world of copies returns them
    def allreduce(self, tensors, opts=None):
        self._count("all_reduce", tensors)
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM

        def copy() -> None:
            for t in tensors:
                _scale(t, op, self._size)

        return self._run("all_reduce", tensors, tensors, copy, self._ring_seconds("all_reduce", tensors))

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def allgather(self, output_lists, inputs, opts=None):
        self._count("all_gather", inputs)

        def copy() -> None:
            for outs, t in zip(output_lists, inputs):
                for o in outs:
                    o.copy_(t)

        return self._run("all_gather", [*inputs, *(o for outs in output_lists for o in outs)], output_lists, copy,
                         self._ring_seconds("all_gather", inputs))

    def all_gather_single(self, output, input, opts=None):
        return self.all_gather_single_coalesced([output], [input], opts)

    _allgather_base = all_gather_single  # torch <= 2.12's name

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        self._count("all_gather", inputs)

        def copy() -> None:
            for o, i in zip(outputs, inputs):
                o.view(self._size, -1).copy_(i.reshape(1, -1).expand(self._size, -1))

        return self._run("all_gather", [*inputs, *outputs], outputs, copy, self._ring_seconds("all_gather", inputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, outputs, input_lists, opts=None):
        inputs = [t for ts in input_lists for t in ts]
        self._count("reduce_scatter", inputs)
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM

        def copy() -> None:
            for o, ts in zip(outputs, input_lists):
                o.copy_(ts[self._rank])
                _scale(o, op, self._size)

        return self._run("reduce_scatter", [*inputs, *outputs], outputs, copy,
                         self._ring_seconds("reduce_scatter", inputs))

    def reduce_scatter_single(self, output, input, opts=None):
        return self.reduce_scatter_single_coalesced([output], [input], opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        self._count("reduce_scatter", inputs)
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM

        def copy() -> None:
            for o, i in zip(outputs, inputs):
                o.copy_(i.view(self._size, -1)[self._rank].view_as(o))
                _scale(o, op, self._size)

        return self._run("reduce_scatter", [*inputs, *outputs], outputs, copy,
                         self._ring_seconds("reduce_scatter", inputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def all_to_all_single(self, output, input, output_splits, input_splits, opts=None):
        self._count("all_to_all", [input])
        if list(output_splits) != list(input_splits):
            raise RuntimeError(f"loopback all_to_all: every peer returns this rank what it sent, {list(input_splits)} "
                               f"rows, but the output expects {list(output_splits)}")
        nbytes = _nbytes([input])
        if input_splits:
            row = nbytes / input.shape[0] if input.shape[0] else 0.0
            bytes_to = [n * row for n in input_splits]
        else:
            bytes_to = [nbytes / self._size] * self._size
        return self._run("all_to_all", [input, output], [output], lambda: output.copy_(input),
                         self._all_to_all_seconds(bytes_to))

    alltoall_base = all_to_all_single  # torch <= 2.12's name

    def alltoall(self, outputs, inputs, opts=None):
        self._count("all_to_all", inputs)

        def copy() -> None:
            for o, i in zip(outputs, inputs):
                o.copy_(i)

        return self._run("all_to_all", [*inputs, *outputs], outputs, copy,
                         self._all_to_all_seconds([float(_nbytes([i])) for i in inputs]))

    def scatter(self, outputs, input_lists, opts=None):
        if not input_lists or not input_lists[0]:
            raise NotImplementedError("loopback scatter: only the source rank knows what it scatters; simulate "
                                      "the source rank (launch.simulate_rank) or read the tensor locally")
        for o, ts in zip(outputs, input_lists):
            o.copy_(ts[self._rank])
        return _done(outputs)

    def broadcast(self, tensors, opts=None):
        return _done(tensors)

    def barrier(self, opts=None):
        return _done(None)

    def send(self, *args, **kwargs):
        raise NotImplementedError("the loopback world (launch.simulate_world) has no point-to-point send")

    recv = recv_anysource = send


def _create(store, rank: int, size: int, timeout: timedelta) -> LoopbackGroup:
    return LoopbackGroup(rank, size)


def init_loopback_world(world_size: int, rank: int, device_type: str, links: LinkConfig | None = None) -> None:
    """The default process group of a loopback world of ``world_size`` ranks, this process being ``rank``;
    ``links``: what its collectives emulate (``launch.links``; None: nothing, the copies alone)."""
    global _LINKS
    _LINKS = links or LinkConfig()
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu", device_type])
    dist.init_process_group(backend=BACKEND, store=dist.HashStore(), rank=rank, world_size=world_size)
