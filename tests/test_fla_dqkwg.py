"""The torch ``chunk_bwd_dqkwg`` (kernels/fla_dqkwg.py) against autograd through the chunk form it differentiates.

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

from kernels.fla_dqkwg import chunk_bwd_dqkwg

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


def test_the_fla_backend_forwards_to_the_torch_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """kernels/fla.py's adapter, against a stand-in for FLA's backend registry (FLA itself needs triton): it
    registers one backend for FLA's 'common' ops, accepts only the gated delta rule's call, and returns what
    chunk_bwd_dqkwg returns, preparing chunk_indices where FLA's caller passes none."""
    import sys
    import types

    from kernels import fla

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
    fla._register_torch_dqkwg.cache_clear()
    try:
        fla._register_torch_dqkwg()
    finally:
        fla._register_torch_dqkwg.cache_clear()
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
