"""The torch ``chunk_bwd_dqkwg`` (kernels/linear_attention/fla_dqkwg.py) against autograd through the chunk form it
differentiates.

The chunk form, per sequence and value head, chunk by chunk (G the chunk-local cumulative natural-log gates; u, w
the WY-representation values and weights, inputs here as FLA's backward treats them at this step):

    v_new = u - w h;   o = scale (q e^G) h + scale tril(q k^T e^(G_i - G_j)) v_new;
    h <- e^(G_last) h + (k e^(G_last - G))^T v_new

With L = <o, do>, the step must return dq = dL/dq, dk = dL/dk through o and the state update, dw = dL/dw and
dg = dL/dG (FLA's gates are G / ln 2: log2 space), given every chunk's entering state h, dh = dL/dh' of the state h'
it leaves (FLA's convention) and dv = dL/dv_new.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels.linear_attention.fla_dqkwg import chunk_bwd_dqkwg

H, J, K, V = 2, 4, 8, 6  # two value heads per q/k head, as Qwen3.5's DeltaNet


def _chunk_indices(lengths: list[int], chunk: int) -> torch.Tensor:
    return torch.tensor([[i, c] for i, n in enumerate(lengths) for c in range(-(-n // chunk))])


def _forward_and_grads(lengths: list[int], batch: int, chunk: int, seed: int = 0):
    """Run the chunk form on ``batch`` rows of the given sequences, keep every chunk's h and v_new, return the
    inputs of chunk_bwd_dqkwg in FLA's layout and the autograd gradients it must reproduce."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    f64 = dict(dtype=torch.float64)
    q, k = (torch.randn(batch, T, H, K, generator=gen, **f64).requires_grad_() for _ in range(2))
    w = (torch.randn(batch, T, J, K, generator=gen, **f64) * 0.3).requires_grad_()
    u = torch.randn(batch, T, J, V, generator=gen, **f64)
    do = torch.randn(batch, T, J, V, generator=gen, **f64)
    gates = -torch.rand(batch, T, J, generator=gen, **f64) * 0.5
    scale = K ** -0.5
    G = torch.zeros(batch, T, J, **f64)  # chunk-local cumsums, a leaf: dg is the gradient w.r.t. these
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    for b in range(batch):
        for start, end in zip(bounds, bounds[1:]):
            for c in range(start, end, chunk):
                G[b, c:min(c + chunk, end)] = gates[b, c:min(c + chunk, end)].cumsum(0)
    G.requires_grad_()
    qJ, kJ = (x.repeat_interleave(J // H, dim=2) for x in (q, k))
    states, leaving, news, outs = [], [], [], []
    for b in range(batch):
        for start, end in zip(bounds, bounds[1:]):
            state = torch.zeros(J, K, V, **f64)
            for c in range(start, end, chunk):
                s = slice(c, min(c + chunk, end))
                qc, kc, gc = qJ[b, s].transpose(0, 1), kJ[b, s].transpose(0, 1), G[b, s].transpose(0, 1)  # [J,L,.]
                states.append(state)
                v_new = u[b, s].transpose(0, 1) - w[b, s].transpose(0, 1) @ state
                v_new.retain_grad()
                news.append(v_new)
                decay = (gc[:, :, None] - gc[:, None, :]).masked_fill(
                    ~torch.ones(gc.shape[1], gc.shape[1], dtype=torch.bool).tril(), -math.inf).exp()
                o = scale * (qc * gc.exp()[..., None]) @ state + scale * ((qc @ kc.transpose(1, 2)) * decay) @ v_new
                outs.append((o.transpose(0, 1), b, s))
                g_last = gc[:, -1]
                state = (g_last.exp()[:, None, None] * state
                         + (kc * (g_last[:, None] - gc).exp()[..., None]).transpose(1, 2) @ v_new)
                state.retain_grad()
                leaving.append(state)
    loss = sum((o * do[b, s]).sum() for o, b, s in outs)
    loss.backward()
    h = torch.stack([x.detach() for x in states])  # [N, J, K, V]
    dh = torch.stack([torch.zeros_like(x) if x.grad is None else x.grad for x in leaving])  # none: a final state
    v_new = torch.zeros(batch, T, J, V, **f64)
    dv = torch.zeros(batch, T, J, V, **f64)
    for x, (_, b, s) in zip(news, outs):
        v_new[b, s], dv[b, s] = x.detach().transpose(0, 1), x.grad.transpose(0, 1)
    inputs = dict(q=q.detach(), k=k.detach(), v=v_new, do=do, h=h[None] if batch == 1 else h.view(batch, -1, J, K, V),
                  dh=dh[None] if batch == 1 else dh.view(batch, -1, J, K, V), w=w.detach(),
                  g=G.detach() / math.log(2), dv=dv, scale=scale, chunk_size=chunk)
    return inputs, (q.grad, k.grad, w.grad, G.grad)


@pytest.mark.parametrize("chunk", [4, 16])
def test_packed_sequences_match_autograd(chunk: int) -> None:
    lengths = [13, 4, 27, 1, 9]  # chunk-crossing, exact-fit and one-token documents
    inputs, expected = _forward_and_grads(lengths, batch=1, chunk=chunk)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    got = chunk_bwd_dqkwg(**inputs, cu_seqlens=cu, chunk_indices=_chunk_indices(lengths, chunk))
    for name, a, b in zip(("dq", "dk", "dw", "dg"), got, expected):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)


def test_batched_rows_match_autograd() -> None:
    inputs, expected = _forward_and_grads([19], batch=3, chunk=8)  # a last chunk of 3 tokens in each row
    got = chunk_bwd_dqkwg(**inputs)
    for name, a, b in zip(("dq", "dk", "dw", "dg"), got, expected):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)


def test_dtypes_follow_fla() -> None:
    inputs, _ = _forward_and_grads([10], batch=1, chunk=4)
    bf16 = {n: (x.bfloat16() if n in ("q", "k", "v", "do", "h", "dh", "w", "dv") else x) for n, x in inputs.items()}
    dq, dk, dw, dg = chunk_bwd_dqkwg(**bf16)
    assert (dq.dtype, dk.dtype, dw.dtype, dg.dtype) == (torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.float32)
    assert dq.shape == (1, 10, H, K) and dw.shape == (1, 10, J, K) and dg.shape == (1, 10, J)


def test_packed_needs_chunk_indices() -> None:
    inputs, _ = _forward_and_grads([10], batch=1, chunk=4)
    with pytest.raises(ValueError, match="chunk_indices"):
        chunk_bwd_dqkwg(**inputs, cu_seqlens=torch.tensor([0, 10]))


def test_the_fla_backend_routes_the_step_by_tile_width(monkeypatch: pytest.MonkeyPatch) -> None:
    """kernels/linear_attention/fla.py's adapter, against a stand-in for FLA's backend registry (FLA itself needs
    triton): it registers one backend for FLA's 'common' ops, accepts only the gated delta rule's call, and for head
    dims of 64 or less (a 64-wide tile, where #640 miscompiles) returns what the torch chunk_bwd_dqkwg returns,
    preparing chunk_indices where FLA's caller passes none; wider heads go to FLA's kernel at 128-wide tiles."""
    import sys
    import types

    from kernels.linear_attention import fla

    registered = {}

    class BaseBackend:
        def __init__(self, *, env_var=None):
            pass

    def register(entry_point):
        def add(cls):
            registered[entry_point] = cls()
            return cls
        return add

    lengths = [13, 4, 27, 1, 9]
    backends = types.ModuleType("fla.backends")
    backends.BaseBackend, backends.register = BaseBackend, register
    index = types.ModuleType("fla.ops.utils.index")
    index.prepare_chunk_indices = lambda cu_seqlens, chunk: _chunk_indices(lengths, chunk)
    for name, module in {"fla": types.ModuleType("fla"), "fla.ops": types.ModuleType("fla.ops"),
                         "fla.ops.utils": types.ModuleType("fla.ops.utils"), "fla.backends": backends,
                         "fla.ops.utils.index": index}.items():
        monkeypatch.setitem(sys.modules, name, module)
    fla.register_hopper_dqkwg.cache_clear()
    try:
        fla.register_hopper_dqkwg()
    finally:
        fla.register_hopper_dqkwg.cache_clear()
    backend = registered["common"]
    inputs, expected = _forward_and_grads(lengths, batch=1, chunk=4)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    call = dict(q=inputs["q"], k=inputs["k"], v=inputs["v"], do=inputs["do"], h=inputs["h"], dh=inputs["dh"],
                w=inputs["w"], g=inputs["g"], dv=inputs["dv"], scale=inputs["scale"], cu_seqlens=cu, chunk_size=4,
                state_v_first=False)
    assert backend.chunk_bwd_dqkwg_verifier(**call) == (True, None)
    assert not backend.chunk_bwd_dqkwg_verifier(**{**call, "g": None})[0]  # other FLA ops' calls: FLA's own kernel
    assert not backend.chunk_bwd_dqkwg_verifier(**{**call, "state_v_first": True})[0]
    for got, want in zip(backend.chunk_bwd_dqkwg(**call), expected):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)

    launched = []
    monkeypatch.setattr(fla, "_launch_wide_dqkwg", lambda *args: launched.append(args[1].shape) or "fla kernel")
    wide = {**call, "q": call["q"].new_zeros(*call["q"].shape[:-1], 128), "k": call["k"].new_zeros(
        *call["k"].shape[:-1], 128), "v": call["v"].new_zeros(*call["v"].shape[:-1], 96)}
    assert backend.chunk_bwd_dqkwg(**wide) == "fla kernel" and launched == [wide["k"].shape]
    assert [fla.wide_dqkwg_tiles(k, v) for k, v in ((128, 128), (100, 96), (256, 128), (64, 128), (128, 64),
                                                    (32, 32))] == [True, True, True, False, False, False]


_H200_TRITON = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU with FLA and triton")


@_H200_TRITON
@pytest.mark.parametrize("lengths", [None, [1, 76, 1971, 1, 2951, 4000, 100, 7284]])
def test_fla_kernel_at_wide_tiles_matches_the_torch_step_on_cuda(lengths: list[int] | None) -> None:
    """The #640 route on a GPU: FLA's kernel launched at 128-wide tiles against the torch step, bf16 inputs at
    Qwen3.5's DeltaNet heads (16 q/k heads, 32 value heads, K = V = 128), one row per batch or packed documents."""
    pytest.importorskip("fla")
    from fla.ops.utils.index import prepare_chunk_indices

    from kernels.linear_attention import fla

    gen, dev, bf16, chunk = torch.Generator("cuda").manual_seed(0), "cuda", torch.bfloat16, 64
    batch, seq = (2, 4096) if lengths is None else (1, sum(lengths))
    cu = None if lengths is None else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=dev)
    indices = None if cu is None else prepare_chunk_indices(cu, chunk)
    # what the trainer's host offsets hand FLA instead (kernels/linear_attention/fla.py): the same indices
    if cu is not None:
        assert torch.equal(fla.host_chunk_indices(cu.cpu(), chunk, cu.device), indices)
    num_chunks = seq // chunk if cu is None else len(indices)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=dev) * scale).to(bf16)

    q, k = rand(batch, seq, 16, 128, scale=0.1), rand(batch, seq, 16, 128, scale=0.1)
    v, do, dv, w = (rand(batch, seq, 32, 128, scale=s) for s in (1.0, 1.0, 1.0, 0.1))
    h, dh = (rand(batch, num_chunks, 32, 128, 128, scale=0.5) for _ in range(2))
    log_decay = -torch.rand(batch, seq, 32, generator=gen, device=dev) * 0.3
    docs = [(0, seq)] if cu is None else list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    chunk_starts = sorted({c for start, end in docs for c in range(start, end, chunk)}) + [seq]
    g = torch.empty_like(log_decay)  # chunk-local cumulative gates, as FLA keeps them
    for start, end in zip(chunk_starts[:-1], chunk_starts[1:]):
        g[:, start:end] = log_decay[:, start:end].cumsum(1)
    args = (q, k, v, do, h, dh, w, g, dv, 128 ** -0.5, cu, chunk, indices)
    for name, got, want in zip(("dq", "dk", "dw", "dg"), fla._launch_wide_dqkwg(*args), chunk_bwd_dqkwg(*args)):
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert err < 1e-2, f"{name}: norm-wise error {err:.2e} against the torch step"

