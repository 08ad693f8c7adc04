"""FLA's ``chunk_bwd_dqkwg`` (one step of the chunked gated delta rule's backward) in plain PyTorch.

Triton 3.4.0 to 3.7.0 miscompile FLA's Triton kernel for this step on Hopper (FLA #640), while FLA's other forward
and backward kernels are right there: on such stacks ``kernels/linear_attention/fla.py`` registers an FLA backend for
that step, which runs FLA's own kernel at 128-wide tiles (right there) and this function for heads of 64 or less, so the
rest of FLA's fast path still runs (the stock torch 2.11 / 2.12.0 stack has triton 3.6).

Per chunk n of C tokens (chunk-local cumulative gates ``g`` in log2 space, as FLA keeps them; ``h``/``dh`` the state
entering the chunk and its gradient; ``v`` the chunk's corrected values ``v_new``; ``dv`` their full gradient):

    dq = scale 2^g (do h^T) + dS k             dS = tril(do v^T 2^(g_i - g_j)) scale
    dk = 2^(g_last - g) (v dh^T) + dS^T q      dw = -dv h^T
    dg = rowsum(dq q) - rowsum(dk k), and the chunk's last row adds 2^g_last <h, dh> + sum(dk k)

(``dg`` is then reverse-cumsummed within each chunk by FLA, as after its own kernel). Every chunk is independent
given ``h`` and ``dh``, so this is a handful of batched products over all chunks at once: no loop over chunks or
documents, no host synchronisation. Products run in fp32 (the kernel accumulates in fp32 too).

Letters: B batch, T time steps, N chunks (B * ceil(T / C), or one per chunk of each packed sequence), C chunk length,
H query/key heads, J value heads (a multiple of H), K key and V value head dims.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def chunk_positions(batch: int, seq_len: int, chunk_size: int, cu_seqlens: Tensor | None,
                    chunk_indices: Tensor | None, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """Flat token index of every chunk slot [N, C], whether the slot is a token [N, C], and each chunk's last
    token [N]; chunks in FLA's order (batch-major, or ``chunk_indices``' (sequence, chunk) pairs when packed)."""
    offsets_C = torch.arange(chunk_size, device=device)
    if cu_seqlens is None:
        num_chunks = -(-seq_len // chunk_size)
        starts_N = (torch.arange(batch, device=device)[:, None] * seq_len
                    + torch.arange(num_chunks, device=device)[None, :] * chunk_size).flatten()
        ends_N = (starts_N // seq_len + 1) * seq_len
    else:
        if chunk_indices is None:
            raise ValueError("packed sequences (cu_seqlens) need FLA's chunk_indices")
        seq_N, chunk_N = chunk_indices[:, 0].long(), chunk_indices[:, 1].long()
        cu = cu_seqlens.long()
        starts_N, ends_N = cu[seq_N] + chunk_N * chunk_size, cu[seq_N + 1]
    pos_NC = starts_N[:, None] + offsets_C
    valid_NC = pos_NC < ends_N[:, None]
    last_N = torch.minimum(starts_N + chunk_size, ends_N) - 1
    return pos_NC, valid_NC, last_N


def chunk_bwd_dqkwg(q: Tensor, k: Tensor, v: Tensor, do: Tensor, h: Tensor, dh: Tensor, w: Tensor, g: Tensor,
                    dv: Tensor, scale: float, cu_seqlens: Tensor | None = None, chunk_size: int = 64,
                    chunk_indices: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """dq, dk [B, T, H, K] (q's and k's dtypes), dw [B, T, J, K] (w's), dg [B, T, J] (fp32; fp64 for fp64 inputs),
    as FLA's kernel returns them for the gated delta rule (``state_v_first=False``: ``h``, ``dh`` are
    [B, N/B, J, K, V]; ``dh`` is the gradient of the state each chunk leaves, FLA's convention)."""
    B, T, H, K = k.shape
    J, V = v.shape[2], v.shape[3]
    acc = torch.promote_types(q.dtype, torch.float32)
    pos_NC, valid_NC, last_N = chunk_positions(B, T, chunk_size, cu_seqlens, chunk_indices, q.device)
    N, C = pos_NC.shape
    safe_NC = torch.where(valid_NC, pos_NC, last_N[:, None])  # padding slots read a real token, then masked to 0
    mask_NC1 = valid_NC[..., None].to(acc)

    def chunks(x_BTJX: Tensor) -> Tensor:  # [B, T, J, X] -> [N, C, J, X], padding zeroed (as the kernel loads)
        flat = x_BTJX.reshape(B * T, *x_BTJX.shape[2:]).to(acc)
        return flat[safe_NC] * mask_NC1[..., None]

    def heads(x_BTHK: Tensor) -> Tensor:  # q/k head i serves value heads i*J/H .. (i+1)*J/H - 1
        return x_BTHK.repeat_interleave(J // H, dim=2)

    q_NCJK, k_NCJK = chunks(heads(q)), chunks(heads(k))
    v_NCJV, do_NCJV, dv_NCJV = chunks(v), chunks(do), chunks(dv)
    h_NJKV, dh_NJKV = h.reshape(N, J, K, V).to(acc), dh.reshape(N, J, K, V).to(acc)
    g_flat = g.reshape(B * T, J).to(acc)
    g_NCJ = g_flat[safe_NC] * mask_NC1
    g_last_NJ = g_flat[last_N]

    dq_NCJK = torch.einsum("ncjv,njkv->ncjk", do_NCJV, h_NJKV) * (torch.exp2(g_NCJ) * scale)[..., None]
    decay_NCJ = torch.where(valid_NC[..., None], torch.exp2(g_last_NJ[:, None] - g_NCJ), 0)
    dk_NCJK = torch.einsum("ncjv,njkv->ncjk", v_NCJV, dh_NJKV) * decay_NCJ[..., None]
    dw_NCJK = -torch.einsum("ncjv,njkv->ncjk", dv_NCJV, h_NJKV)
    dg_last_NJ = (h_NJKV * dh_NJKV).sum((-2, -1)) * torch.exp2(g_last_NJ) + (dk_NCJK * k_NCJK).sum((1, 3))

    causal_CC = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    keep_NJCC = (causal_CC & valid_NC[:, :, None] & valid_NC[:, None, :])[:, None]
    gap_NJCC = (g_NCJ.transpose(1, 2)[..., :, None] - g_NCJ.transpose(1, 2)[..., None, :])
    ds_NJCC = torch.einsum("ncjv,nsjv->njcs", do_NCJV, v_NCJV)
    ds_NJCC = torch.where(keep_NJCC, ds_NJCC * torch.exp2(gap_NJCC.masked_fill(~keep_NJCC, 0)), 0) * scale
    dq_NCJK = dq_NCJK + torch.einsum("njcs,nsjk->ncjk", ds_NJCC, k_NCJK)
    dk_NCJK = dk_NCJK + torch.einsum("njcs,ncjk->nsjk", ds_NJCC, q_NCJK)
    dg_NCJ = (dq_NCJK * q_NCJK).sum(-1) - (dk_NCJK * k_NCJK).sum(-1)
    is_last_NC = pos_NC == last_N[:, None]
    dg_NCJ = dg_NCJ + is_last_NC[..., None] * dg_last_NJ[:, None]

    # Back to [B, T, ...]: every token is in exactly one chunk; padding slots write to a spare row, dropped.
    out_NC = torch.where(valid_NC, pos_NC, B * T)

    def tokens(x_NCJX: Tensor) -> Tensor:
        out = x_NCJX.new_zeros(B * T + 1, *x_NCJX.shape[2:])
        out[out_NC] = x_NCJX
        return out[:B * T].reshape(B, T, *x_NCJX.shape[2:])

    # A q/k head's gradient sums over the value heads it serves.
    dq, dk = (tokens(x).view(B, T, H, J // H, K).sum(3) for x in (dq_NCJK, dk_NCJK))
    dg = tokens(dg_NCJ[..., None])[..., 0]
    return dq.to(q.dtype), dk.to(k.dtype), tokens(dw_NCJK).to(w.dtype), dg
