"""The chunked gated delta rule against the token-by-token recurrence (fp32 CPU, forward and every gradient), and
both against transformers' torch references."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_qwen35

from kernels.linear_attention.delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule

# 70 tokens: several chunks at every size, none a multiple of it; 4 value heads share 2 q/k heads; k != v.
B, T, h, H, K, V = 2, 70, 2, 4, 16, 24


def _inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # Decays from ~e^-0.01 to ~e^-15 per token (the model's -exp(A_log) * softplus(.) spans that range).
    decay_rate = torch.empty(B, T, H).uniform_(-5, 2.5, generator=g).exp()
    return dict(
        q=torch.randn(B, T, h, K, generator=g), k=torch.randn(B, T, h, K, generator=g),
        v=torch.randn(B, T, H, V, generator=g), g=-decay_rate * F.softplus(torch.randn(B, T, H, generator=g)),
        beta=torch.rand(B, T, H, generator=g), initial_state=torch.randn(B, H, K, V, generator=g),
    )


def _run(rule, inputs: dict[str, torch.Tensor], **kwargs) -> tuple[torch.Tensor, ...]:
    """Output, final state and the gradient of every input under a fixed random projection of both."""
    leaves = {name: x.clone().requires_grad_() for name, x in inputs.items()}
    o, state = rule(**leaves, output_final_state=True, use_qk_l2norm_in_kernel=True, **kwargs)
    g = torch.Generator().manual_seed(1)
    loss = (o * torch.randn(o.shape, generator=g)).sum() + (state * torch.randn(state.shape, generator=g)).sum()
    loss.backward()
    return (o.detach(), state.detach(), *(x.grad for x in leaves.values()))


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
def test_chunked_matches_recurrent(chunk_size: int) -> None:
    inputs = _inputs()
    chunked = _run(chunk_gated_delta_rule, inputs, chunk_size=chunk_size)
    recurrent = _run(recurrent_gated_delta_rule, inputs)
    # Outputs and states are O(1): 1e-5 is ~10x the fp32 reordering error (<= 1.1e-6 measured, at chunk 64).
    torch.testing.assert_close(chunked[0], recurrent[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(chunked[1], recurrent[1], rtol=0, atol=1e-5)
    names = ["q", "k", "v", "g", "beta", "initial_state"]
    errors = {name: _rel_err(a, b) for name, a, b in zip(names, chunked[2:], recurrent[2:])}
    # Relative (norm-wise) per input, as gradient sizes differ by input (g's sums over every later token);
    # <= 1.1e-6 measured.
    assert max(errors.values()) < 1e-5, errors


def test_scale_no_l2norm_autocast_and_dtypes() -> None:
    inputs = _inputs(seed=2)
    kwargs = dict(scale=0.3, output_final_state=True)
    # Without the in-kernel l2norm, keys must stay small for the recurrence to be stable: unit-norm rows.
    inputs["k"] = F.normalize(inputs["k"], dim=-1)
    o_c, s_c = chunk_gated_delta_rule(**inputs, chunk_size=16, **kwargs)
    o_r, s_r = recurrent_gated_delta_rule(**inputs, **kwargs)
    torch.testing.assert_close(o_c, o_r, rtol=0, atol=1e-5)
    torch.testing.assert_close(s_c, s_r, rtol=0, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # must not push the products and solves into bf16
        torch.testing.assert_close(chunk_gated_delta_rule(**inputs, chunk_size=16, **kwargs)[0], o_c)
    # FLA's contract: the output in the input dtype, the state in fp32; none requested -> None.
    bf16 = {name: x.bfloat16() for name, x in inputs.items()}
    o, state = chunk_gated_delta_rule(**bf16, chunk_size=16, scale=0.3)
    assert o.dtype == torch.bfloat16 and state is None
    assert chunk_gated_delta_rule(**bf16, chunk_size=16, output_final_state=True)[1].dtype == torch.float32


def _torch_only(hf_function):
    """transformers' torch function itself: where flash-linear-attention is installed, transformers (5.17 and later)
    wraps its ``torch_*`` delta rules to run FLA's Triton kernels instead, which cannot take CPU tensors."""
    return inspect.unwrap(hf_function)


def test_matches_transformers_reference() -> None:
    inputs = _inputs(seed=3)
    kwargs = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    qkv = [inputs.pop(name) for name in ("q", "k", "v")]  # transformers names them query, key, value
    pairs = [
        (chunk_gated_delta_rule(*qkv, **inputs, chunk_size=32, **kwargs),
         _torch_only(hf_qwen35.torch_chunk_gated_delta_rule)(*qkv, **inputs, chunk_size=32, **kwargs)),
        (recurrent_gated_delta_rule(*qkv, **inputs, **kwargs),
         _torch_only(hf_qwen35.torch_recurrent_gated_delta_rule)(*qkv, **inputs, **kwargs)),
    ]
    for (o, state), (o_ref, state_ref) in pairs:
        # Same algorithms in fp32: only the memory layout (and so the summation order) may differ.
        torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-6)
        torch.testing.assert_close(state, state_ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("chunk_size", [4, 16])
def test_packed_sequences_run_in_one_pass_as_one_call_each(chunk_size: int) -> None:
    """cu_seqlens: one pass over chunk-aligned sequences equals calling the rule per sequence, outputs, final
    states and gradients, with and without initial states (chunk-crossing, exact-fit and one-token sequences)."""
    torch.manual_seed(0)
    lengths = [13, 16, 1, 30, 4]
    T, h, H, dk, dv = sum(lengths), 2, 4, 8, 6
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    leaves = [torch.randn(1, T, h, dk), torch.randn(1, T, h, dk), torch.randn(1, T, H, dv),
              -torch.rand(1, T, H), torch.rand(1, T, H), torch.randn(len(lengths), H, dk, dv)]
    for with_state in (False, True):
        packed = [x.clone().requires_grad_() for x in leaves]
        q, k, v, g, beta, s0 = packed
        o, final = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0 if with_state else None,
                                          output_final_state=True, use_qk_l2norm_in_kernel=True,
                                          chunk_size=chunk_size, cu_seqlens=cu)
        (o.square().sum() + final.square().sum()).backward()
        single = [x.clone().requires_grad_() for x in leaves]
        outs, finals = [], []
        for i, (a, b) in enumerate(zip(cu.tolist(), cu.tolist()[1:])):
            o_i, f_i = chunk_gated_delta_rule(*(x[:, a:b] for x in single[:5]),
                                              initial_state=single[5][i:i + 1] if with_state else None,
                                              output_final_state=True, use_qk_l2norm_in_kernel=True,
                                              chunk_size=chunk_size)
            outs.append(o_i)
            finals.append(f_i)
        (torch.cat(outs, 1).square().sum() + torch.cat(finals).square().sum()).backward()
        torch.testing.assert_close(o, torch.cat(outs, 1), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(final, torch.cat(finals), rtol=1e-5, atol=1e-5)
        for a, b in zip(packed[:5 + with_state], single[:5 + with_state]):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)


def test_deltanet_takes_the_projection_whole_and_trains_as_with_the_concatenation(monkeypatch) -> None:
    """Without CP the conv takes in_proj_qkv's output itself (``tiled_base``: no concatenation copy, no split
    concatenation in backward); output and every gradient equal the concatenating path's, packed documents too."""
    from kernels.attention.attention import DenseMaskAttention
    from models import build_args
    from models.layers import document_ids
    from models.qwen3_5_moe import deltanet
    from tests.test_kernels import QWEN35

    torch.manual_seed(0)
    layer = deltanet.GatedDeltaNet(build_args("qwen3_5_moe", QWEN35))
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 40, QWEN35["hidden_size"])
    pos = torch.cat([torch.arange(7), torch.arange(1), torch.arange(32)]).expand(2, 40)
    taken = []
    tiled = deltanet.tiled_base

    def spy(parts):
        taken.append(tiled(parts) is not None)
        return tiled(parts)

    def run(docs):
        layer.zero_grad()
        out = layer(x, docs)
        out.square().sum().backward()
        return [out.detach(), *(p.grad.clone() for p in layer.parameters())]

    for docs in (None, DenseMaskAttention().documents(document_ids(pos))):
        monkeypatch.setattr(deltanet, "tiled_base", spy)
        whole = run(docs)
        monkeypatch.setattr(deltanet, "tiled_base", lambda parts: None)
        concatenated = run(docs)
        for a, b in zip(whole, concatenated):
            assert torch.equal(a, b)
    assert taken == [True, True]


def _packed_rows(lengths_per_row: list[list[int]], seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor]:
    """q, k, v, g, beta for rows of packed documents and cu_seqlens over the flattened rows (g as the model's)."""
    gen = torch.Generator().manual_seed(seed)
    T, h, H, dk, dv = sum(lengths_per_row[0]), 2, 4, 8, 6
    assert all(sum(row) == T for row in lengths_per_row)
    R = len(lengths_per_row)
    flat = [n for row in lengths_per_row for n in row]
    cu = torch.tensor([0, *torch.tensor(flat).cumsum(0).tolist()])
    decay = torch.empty(R, T, H).uniform_(-5, 2.5, generator=gen).exp()
    return [torch.randn(R, T, h, dk, generator=gen), torch.randn(R, T, h, dk, generator=gen),
            torch.randn(R, T, H, dv, generator=gen), -decay * F.softplus(torch.randn(R, T, H, generator=gen)),
            torch.rand(R, T, H, generator=gen)], cu


# Rows of 80 tokens: one-token documents, documents crossing a chunk of 16 or 64, a row that is one document.
ROWS = [[1, 1, 70, 3, 5], [80], [17, 47, 16]]


def _grads(rule, leaves: list[torch.Tensor], **kwargs) -> list[torch.Tensor]:
    xs = [x.clone().requires_grad_() for x in leaves]
    o, _ = rule(*xs[:3], g=xs[3], beta=xs[4], use_qk_l2norm_in_kernel=True, **kwargs)
    (o * torch.randn(o.shape, generator=torch.Generator().manual_seed(1))).sum().backward()
    return [o.detach(), *(x.grad for x in xs)]


def test_rows_of_packed_documents_are_the_flattened_rows() -> None:
    """cu_seqlens over the flattened B x T tokens (what the model passes): the same as the rows concatenated into a
    batch of one, output and every gradient; a row start that is not a document start is refused."""
    leaves, cu = _packed_rows(ROWS)
    rows = _grads(chunk_gated_delta_rule, leaves, cu_seqlens=cu, chunk_size=16)
    flat = _grads(chunk_gated_delta_rule, [x.flatten(0, 1)[None] for x in leaves], cu_seqlens=cu, chunk_size=16)
    for a, b in zip(rows, flat):
        torch.testing.assert_close(a, b.view_as(a), rtol=0, atol=0)
    with pytest.raises(ValueError, match="every row start"):
        chunk_gated_delta_rule(*leaves[:3], g=leaves[3], beta=leaves[4], cu_seqlens=torch.tensor([0, 100, 240]))


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_documents_reset_through_the_decay_are_the_documents_on_their_own(chunk_size: int) -> None:
    """kernels/linear_attention/fla.py's reset launch, checked on the torch rule in fp32: each row run as one sequence
    with every document's first decay set to DOCUMENT_RESET_G gives the output and gradients of the documents run as
    sequences of their own (cu_seqlens), including g's gradient (0 at a document's first token either way)."""
    from kernels.linear_attention.fla import documents_as_decay_reset

    leaves, cu = _packed_rows(ROWS, seed=3)
    want = _grads(chunk_gated_delta_rule, leaves, cu_seqlens=cu, chunk_size=chunk_size)

    def reset_rule(q, k, v, g, beta, **kwargs):
        return chunk_gated_delta_rule(q, k, v, documents_as_decay_reset(g, cu), beta, **kwargs)

    got = _grads(reset_rule, leaves, chunk_size=chunk_size)
    for name, a, b in zip(["o", "dq", "dk", "dv", "dg", "dbeta"], got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
    starts = torch.zeros(cu[-1].item(), dtype=torch.bool).index_fill_(0, cu[:-1], True)
    assert (got[4].flatten(0, 1)[starts] == 0).all()
