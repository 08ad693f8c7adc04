"""Ulysses context parallelism (``parallel.cp_mode=ulysses``).

Each of the cp ranks of a dp slice holds a contiguous 1/cp of every sequence (``training.data.packing.context_shard``).
Around each sequence op a model declares (``sequence_ops``, see ``models/sequence_ops.py``) an all-to-all trades
the sequence shard for a head shard: the op runs on 1/cp of the heads over the whole sequence, and a second
all-to-all trades back. Everything else is token-wise and runs on the local tokens unchanged: projections, norms,
RoPE (each token with its own position id), the MoE layers with their EP all-to-all. The declaration says what
each argument is, so nothing here knows a model:

- ``Heads`` (e.g. attention's q [B, H, t, d] -> [B, H/cp, T, d], k and v likewise; DeltaNet's q, k, v, g, beta): one
  all-to-all per dtype for all of an op's head arguments; the result back the same way.
- ``HeadWeights`` (e.g. DeltaNet's conv taps [heads, ., W]): sliced to this rank's heads, so the causal conv runs
  on the whole sequence of this rank's channels.
- ``WholeSequence`` (the position ids that document ids come from): one all-gather per forward.

Heads fewer than cp (attention's kv heads, DeltaNet's q/k heads) are repeated to cp first (validate checks that cp
is a multiple of their count), so each rank receives the one head its query/value heads share; autograd sums the
copies' gradients. Gradients need nothing else: each rank's loss share is normalised by the global token count,
the dense gradients are averaged over all dp x cp ranks, and expert weights are replicated over expert_cp (see
docs/parallel.md).

Letters as in DEVELOPERS.md (t = T/cp local tokens, P = cp ranks), plus: n the heads of whichever tensor (its H or
h), m the features sent to one rank in one all-to-all (the flattened rest).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from core.torch_compat import all_gather_tensor, all_to_all_single_autograd
from models.sequence_ops import Heads, HeadWeights, SequenceOp, WholeSequence

Tensor = torch.Tensor


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Wrap every sequence op of ``model`` (``sequence_ops``, see ``models/sequence_ops.py``) for Ulysses CP over
    ``cp_mesh``, in place."""
    group = cp_mesh.get_group()
    roles = []
    for module in model.modules():
        for attr, op in getattr(module, "sequence_ops", {}).items():
            setattr(module, attr, _ulysses(getattr(module, attr), op, group))
            roles += _flat(op.args)
    if not any(isinstance(r, Heads) for r in roles) or not any(isinstance(r, WholeSequence) for r in roles):
        raise ValueError(f"{type(model).__name__} declares no sequence op over heads, or none that takes the whole "
                         "sequence's positions; context parallelism needs both (see models/sequence_ops.py)")


def _flat(roles: tuple) -> list:
    return [leaf for r in roles for leaf in (_flat(r) if isinstance(r, tuple) else [r])]


def _ulysses(op: Callable[..., Any], spec: SequenceOp, group: dist.ProcessGroup) -> Callable[..., Any]:
    """``op`` on a head shard of the whole sequence, called with (and returning) the local tokens: one all-to-all
    for the ``Heads`` arguments (per dtype), this rank's slice of ``HeadWeights``, ``WholeSequence`` gathered."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)

    def prepare(value: Any, role: Any) -> Any:
        if isinstance(role, tuple):
            return tuple(prepare(v, r) for v, r in zip(value, role))
        if isinstance(role, HeadWeights):
            w = _spread_heads(value, role.dim, cp) if role.shared else value
            return w.chunk(cp, dim=role.dim)[rank]  # whole on every rank (FSDP gathered it): this rank's heads
        if isinstance(role, WholeSequence):
            return all_gather_tensor(value.contiguous(), gather_dim=role.dim % value.dim(), group=group)
        return value  # Passed

    @functools.wraps(op)
    def wrapped(*args: Any) -> Any:
        heads = [i for i, role in enumerate(spec.args) if isinstance(role, Heads)]
        # [B, t, n, *rest]: the layout the all-to-alls split (heads after the sequence); all in one call.
        xs = [_to_btn(args[i], spec.args[i]) for i in heads]
        xs = [_spread_heads(x, 2, cp) if spec.args[i].shared else x for i, x in zip(heads, xs)]
        local = {i: _from_btn(x, spec.args[i]) for i, x in zip(heads, seq_to_heads(xs, group))}
        out = op(*(local[i] if i in local else prepare(a, r) for i, (a, r) in enumerate(zip(args, spec.args))))
        return out if spec.out is None else _from_btn(heads_to_seq(_to_btn(out, spec.out), group), spec.out)

    return wrapped


def _to_btn(x: Tensor, role: Heads) -> Tensor:
    return x.movedim((role.seq_dim, role.head_dim), (1, 2))


def _from_btn(x: Tensor, role: Heads) -> Tensor:
    return x.movedim((1, 2), (role.seq_dim, role.head_dim))


def seq_to_heads(xs: list[Tensor], group: dist.ProcessGroup) -> list[Tensor]:
    """[B, t, n, *rest] each -> [B, P*t, n/P, *rest]: rank r gets heads [r*n/P, (r+1)*n/P) of the whole sequence.
    One all-to-all per dtype (tensors of a dtype travel together)."""
    P = dist.get_world_size(group)
    out: list[Tensor | None] = [None] * len(xs)
    for dtype in dict.fromkeys(x.dtype for x in xs):  # first-seen order: the same collectives on every rank
        index = [i for i, x in enumerate(xs) if x.dtype == dtype]
        # Head group r of every tensor, side by side, is the chunk for rank r.
        send_PBtm = torch.cat([xs[i].reshape(*xs[i].shape[:2], P, -1).movedim(2, 0) for i in index], dim=-1)
        recv_PBtm = all_to_all_single_autograd(send_PBtm.contiguous(), None, None, group)  # P = source seq shard
        widths = [math.prod(xs[i].shape[2:]) // P for i in index]
        for i, part_PBtm in zip(index, recv_PBtm.split(widths, dim=-1)):
            B, t, n, *rest = xs[i].shape
            out[i] = part_PBtm.movedim(0, 1).reshape(B, P * t, n // P, *rest)
    return out  # type: ignore[return-value]


def heads_to_seq(x_BTn_: Tensor, group: dist.ProcessGroup) -> Tensor:
    """The inverse of ``seq_to_heads`` for one tensor: [B, T, n, *rest] -> [B, T/P, P*n, *rest]."""
    P = dist.get_world_size(group)
    B, T, n, *rest = x_BTn_.shape
    send_PBtm = x_BTn_.reshape(B, P, T // P, -1).movedim(1, 0).contiguous()  # sequence shard r for rank r
    recv_PBtm = all_to_all_single_autograd(send_PBtm, None, None, group)  # P = source head group
    return recv_PBtm.permute(1, 2, 0, 3).reshape(B, T // P, P * n, *rest)


def _spread_heads(x: Tensor, dim: int, cp: int) -> Tensor:
    """Repeat each head cp/n times when there are fewer heads n than cp ranks, so every rank gets a whole one."""
    n = x.shape[dim]
    return x if n % cp == 0 else x.repeat_interleave(cp // n, dim=dim)
