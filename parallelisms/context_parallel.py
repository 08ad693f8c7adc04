"""Ulysses context parallelism (``parallel.cp_mode=ulysses``).

Each of the cp ranks of a dp slice holds a contiguous 1/cp of every sequence (``training.data.context_shard``).
Around each sequence op a model declares (``sequence_ops``, see ``models/layers.py``) an all-to-all trades the
sequence shard for a head shard: the op runs on 1/cp of the heads over the whole sequence, and a second all-to-all
trades back. Everything else is token-wise and runs on the local tokens unchanged: projections, norms, RoPE (each
token with its own position id), the MoE layers with their EP all-to-all.

- attention: q, k, v [B, H, t, d] -> [B, H/cp, T, d]; the output back.
- delta_rule (Gated DeltaNet): q, k, v, g, beta -> head shards; the conv taps [heads, ., K] are sliced to the same
  heads, so the causal conv runs on the whole sequence of this rank's channels; the output back.
- documents: document ids need every rank's position ids: one all-gather per forward.

Heads fewer than cp (attention's kv heads, DeltaNet's q/k heads) are repeated to cp first (validate checks that cp
is a multiple of their count), so each rank receives the one head its query/value heads share; autograd sums the
copies' gradients. Gradients need nothing else: each rank's loss share is normalised by the global token count,
the dense gradients are averaged over all dp x cp ranks, and expert weights are replicated over expert_cp (see
docs/parallel.md).

Letters: t = T/cp local tokens, n heads of a tensor, P = cp.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._functional_collectives import all_gather_tensor, all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh

Tensor = torch.Tensor


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Wrap every sequence op of ``model`` for Ulysses CP over ``cp_mesh``, in place."""
    group = cp_mesh.get_group()
    wrappers = {"attention": _ulysses_attention, "delta_rule": _ulysses_delta_rule, "documents": _gathered_documents}
    kinds = set()
    for module in model.modules():
        for attr, kind in getattr(module, "sequence_ops", {}).items():
            setattr(module, attr, wrappers[kind](getattr(module, attr), group))
            kinds.add(kind)
    if "documents" not in kinds or not kinds & {"attention", "delta_rule"}:
        raise ValueError(f"{type(model).__name__} declares sequence ops {sorted(kinds)}; context parallelism needs "
                         "'documents' and at least one token mixer (see sequence_ops in models/layers.py)")


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


def _ulysses_attention(core: Callable[..., Tensor], group: dist.ProcessGroup) -> Callable[..., Tensor]:
    cp = dist.get_world_size(group)

    @functools.wraps(core)
    def attention(q_BHtd: Tensor, k_BhTd: Tensor, v_BhTd: Tensor, doc_ids_BT: Tensor | None) -> Tensor:
        # [B, t, n, d]: the layout the all-to-alls split (heads after the sequence).
        q_BtHd, k_Bthd, v_Bthd = (x.transpose(1, 2) for x in (q_BHtd, k_BhTd, v_BhTd))
        k_Bthd, v_Bthd = _spread_heads(k_Bthd, 2, cp), _spread_heads(v_Bthd, 2, cp)
        q_BTHd, k_BThd, v_BThd = seq_to_heads([q_BtHd, k_Bthd, v_Bthd], group)
        o_BHTd = core(q_BTHd.transpose(1, 2), k_BThd.transpose(1, 2), v_BThd.transpose(1, 2), doc_ids_BT)
        return heads_to_seq(o_BHTd.transpose(1, 2), group).transpose(1, 2)

    return attention


def _ulysses_delta_rule(core: Callable[..., Tensor], group: dist.ProcessGroup) -> Callable[..., Tensor]:
    cp, rank = dist.get_world_size(group), dist.get_rank(group)

    @functools.wraps(core)
    def delta_rule(q_Bthk: Tensor, k_Bthk: Tensor, v_BtHv: Tensor, g_BtH: Tensor, beta_BtH: Tensor,
                   conv_weights: tuple[Tensor, Tensor, Tensor], doc_ids_BT: Tensor | None) -> Tensor:
        conv_q, conv_k, conv_v = conv_weights  # [h, k, K], [h, k, K], [H, v, K]: the taps of each head's channels
        q_Bthk, k_Bthk = _spread_heads(q_Bthk, 2, cp), _spread_heads(k_Bthk, 2, cp)
        conv_q, conv_k = _spread_heads(conv_q, 0, cp), _spread_heads(conv_k, 0, cp)
        local = seq_to_heads([q_Bthk, k_Bthk, v_BtHv, g_BtH, beta_BtH], group)
        # The weights are whole on every rank (FSDP has gathered them): take this rank's heads' taps.
        conv_local = tuple(w.chunk(cp)[rank] for w in (conv_q, conv_k, conv_v))
        return heads_to_seq(core(*local, conv_local, doc_ids_BT), group)

    return delta_rule


def _gathered_documents(find: Callable[[Tensor], Any], group: dist.ProcessGroup) -> Callable[[Tensor], Any]:
    @functools.wraps(find)
    def find_documents(position_ids: Tensor) -> Any:
        # The local position ids stay for RoPE; the documents are those of the whole sequence.
        return find(all_gather_tensor(position_ids.contiguous(), gather_dim=position_ids.dim() - 1, group=group))

    return find_documents
