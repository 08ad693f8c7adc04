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

The copies are device copies on the stream the caller is on (FSDP's all-gather stream, say), each inside a
profiler range named ``loopback <collective>`` so that a profile counts them apart from compute. What is sent is
counted per collective kind and group (``COUNTED``): bytes of each call's input, as the planner counts.
Point-to-point sends and receives (no layout of this project uses them) are refused by name.
"""

from __future__ import annotations

import collections
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.futures import Future

from core.torch_compat import premul_sum_factor, work_from_future

BACKEND = "loopback"
# Bytes of each collective's input by (kind, group name), summed over the process's calls (one rank's share).
COUNTED: collections.Counter = collections.Counter()


def _done(result) -> dist.Work:
    future: Future = Future()
    future.set_result(result)
    return work_from_future(future)


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

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self._rank, self._size, self._name = rank, size, ""

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
        COUNTED[kind, self.group_name] += sum(t.numel() * t.element_size() for t in tensors)

    # -- the collectives, as a world of copies returns them
    def allreduce(self, tensors, opts=None):
        self._count("all_reduce", tensors)
        with torch.profiler.record_function("loopback all_reduce"):
            for t in tensors:
                _scale(t, opts.reduceOp if opts is not None else dist.ReduceOp.SUM, self._size)
        return _done(tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def allgather(self, output_lists, inputs, opts=None):
        self._count("all_gather", inputs)
        with torch.profiler.record_function("loopback all_gather"):
            for outs, t in zip(output_lists, inputs):
                for o in outs:
                    o.copy_(t)
        return _done(output_lists)

    def all_gather_single(self, output, input, opts=None):
        self._count("all_gather", [input])
        with torch.profiler.record_function("loopback all_gather"):
            output.view(self._size, -1).copy_(input.reshape(1, -1).expand(self._size, -1))
        return _done([output])

    _allgather_base = all_gather_single  # torch <= 2.12's name

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        for o, i in zip(outputs, inputs):
            self.all_gather_single(o, i, opts)
        return _done(outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, outputs, input_lists, opts=None):
        self._count("reduce_scatter", [t for ts in input_lists for t in ts])
        with torch.profiler.record_function("loopback reduce_scatter"):
            for o, ts in zip(outputs, input_lists):
                o.copy_(ts[self._rank])
                _scale(o, opts.reduceOp if opts is not None else dist.ReduceOp.SUM, self._size)
        return _done(outputs)

    def reduce_scatter_single(self, output, input, opts=None):
        self._count("reduce_scatter", [input])
        with torch.profiler.record_function("loopback reduce_scatter"):
            output.copy_(input.view(self._size, -1)[self._rank].view_as(output))
            _scale(output, opts.reduceOp if opts is not None else dist.ReduceOp.SUM, self._size)
        return _done([output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        for o, i in zip(outputs, inputs):
            self.reduce_scatter_single(o, i, opts)
        return _done(outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def all_to_all_single(self, output, input, output_splits, input_splits, opts=None):
        self._count("all_to_all", [input])
        if list(output_splits) != list(input_splits):
            raise RuntimeError(f"loopback all_to_all: every peer returns this rank what it sent, {list(input_splits)} "
                               f"rows, but the output expects {list(output_splits)}")
        with torch.profiler.record_function("loopback all_to_all"):
            output.copy_(input)
        return _done([output])

    alltoall_base = all_to_all_single  # torch <= 2.12's name

    def alltoall(self, outputs, inputs, opts=None):
        self._count("all_to_all", inputs)
        with torch.profiler.record_function("loopback all_to_all"):
            for o, i in zip(outputs, inputs):
                o.copy_(i)
        return _done(outputs)

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


def init_loopback_world(world_size: int, rank: int, device_type: str) -> None:
    """The default process group of a loopback world of ``world_size`` ranks, this process being ``rank``."""
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu", device_type])
    dist.init_process_group(backend=BACKEND, store=dist.HashStore(), rank=rank, world_size=world_size)
