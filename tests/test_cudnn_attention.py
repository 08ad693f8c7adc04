"""cuDNN's ragged document attention (``kernels/attention/cudnn_attention.py``) on CPU: its graph key (documents padded
to buckets), and its whole path (graphs, ragged offsets, strides, the custom op's forward and backward, autograd,
torch.compile) run against a reference interpreter of the cuDNN graphs it builds, compared with the dense-mask
reference and with every document run alone. The interpreter executes what a graph declares (each tensor's dims,
strides and ragged offsets, the sequence lengths, the causal band) with torch's math, so a wrong offset, stride,
binding or flag moves values by O(1). The real cuDNN kernel is compared with the same reference on CUDA
(tests/test_attention.py::test_cuda_kernels_equal_the_dense_mask) and in scripts/check_kernels.py."""

from __future__ import annotations

import contextlib
import copy
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from kernels.attention import cudnn_attention
from kernels.attention.attention import DenseMaskAttention, causal_sdpa, document_cu_seqlens
from kernels.attention.cudnn_attention import CudnnAttention, ragged_documents
from models.layers import document_ids, known_documents
from tests.test_attention import (FAMILIES, LENGTHS, T, _ids, each_document_alone, loss_and_grads, out_and_grads,
                                  position_ids, qkv, tiny_model, use_attention)


# --- the graph key ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("lengths, row, documents, longest", [
    ([[1, 127, 130, 1, 1, 40], [300]], 300, 16, 300),  # 7 documents: the smallest bucket; the longest: the row
    ([[20] * 17], 340, 32, 128),  # 17 documents: the next power of two; the longest's smallest bucket
    ([[129, 100], [1] * 229], 229, 256, 229),  # 231 documents
    ([[2048] * 16], 32768, 16, 2048),
])
def test_ragged_documents_pad_to_buckets_with_empty_documents(lengths, row, documents, longest) -> None:
    """The document count and the longest document rounded up to powers of two (the longest at most the row): the
    extra documents are empty, at the end; the host's known offsets give the same."""
    ids_BT = _ids(lengths)
    assert ids_BT.shape[1] == row
    cu_n1 = document_cu_seqlens(ids_BT)
    ragged = ragged_documents(cu_n1, int(cu_n1.diff().max()), row)
    assert ragged.cu_seqlens_m1.dtype == torch.int64 and ragged.cu_seqlens_m1.numel() == documents + 1
    assert ragged.longest == longest
    n = cu_n1.numel() - 1
    assert torch.equal(ragged.cu_seqlens_m1[:n + 1], cu_n1)
    assert (ragged.cu_seqlens_m1[n:] == ids_BT.numel()).all()
    docs = CudnnAttention().documents(ids_BT, known_documents(position_ids(lengths), torch.device("cpu")))
    assert torch.equal(docs.ragged.cu_seqlens_m1, ragged.cu_seqlens_m1) and docs.ragged.longest == longest


def test_refuses_fp32_and_keeps_the_causal_path() -> None:
    attention, (q, k, v) = CudnnAttention(), qkv()
    docs = attention.documents(document_ids(position_ids(LENGTHS)))
    with pytest.raises(ValueError, match=r"cudnn_attention runs bf16 or fp16, .*float32; fix: "):
        attention(q, k, v, docs, 0.25)
    torch.testing.assert_close(attention(q, k, v, None, 0.25), causal_sdpa(q, k, v, 0.25))


# --- a reference interpreter of the graphs ------------------------------------------------------------------------

@dataclass(eq=False)
class Node:
    """A graph tensor: what the module declared about it."""

    name: str
    dim: list[int] | None = None
    stride: list[int] | None = None
    data_type: str | None = None
    ragged: Node | None = None
    output: bool = False

    def set_ragged_offset(self, offsets: Node) -> Node:
        self.ragged = offsets
        return self

    def set_output(self, output: bool) -> Node:
        self.output = output
        return self

    def set_dim(self, dim: list[int]) -> Node:
        self.dim = list(dim)
        return self

    def set_stride(self, stride: list[int]) -> Node:
        self.stride = list(stride)
        return self

    def set_data_type(self, data_type: str) -> Node:
        self.data_type = data_type
        return self


@dataclass
class Graph:
    io_data_type: str
    intermediate_data_type: str
    compute_data_type: str
    handle: Any
    op: tuple[str, dict] | None = None
    built: list[str] = field(default_factory=list)
    executed: int = 0

    def tensor(self, name: str, dim: list[int], stride: list[int], data_type: str) -> Node:
        return Node(name, list(dim), list(stride), data_type)

    def sdpa(self, name: str, q: Node, k: Node, v: Node, **attrs: Any) -> tuple[Node, Node]:
        self.op = ("sdpa", dict(q=q, k=k, v=v, **attrs))
        self.outputs = (Node("O"), Node("Stats"))
        return self.outputs

    def sdpa_backward(self, name: str, q: Node, k: Node, v: Node, o: Node, dO: Node, stats: Node,  # noqa: N803
                      **attrs: Any) -> tuple[Node, Node, Node]:
        self.op = ("sdpa_backward", dict(q=q, k=k, v=v, o=o, dO=dO, stats=stats, **attrs))
        self.outputs = (Node("dQ"), Node("dK"), Node("dV"))
        return self.outputs

    def validate(self) -> None:
        self.built.append("validate")

    def build_operation_graph(self) -> None:
        self.built.append("operation_graph")

    def create_execution_plans(self, modes: list[str]) -> None:
        assert modes == ["A", "FALLBACK"]
        self.built.append("plans")

    def check_support(self) -> None:
        self.built.append("support")

    def build_plans(self) -> None:
        self.built.append("build")

    def get_workspace_size(self) -> int:
        return 0

    def execute(self, pack: dict[Node, torch.Tensor], workspace: torch.Tensor, handle: Any) -> None:
        """Run the graph's one op the way cuDNN defines it, reading and writing only through what was declared."""
        assert self.built == ["validate", "operation_graph", "plans", "support", "build"] and handle is self.handle
        assert all(x.output for x in self.outputs), "every output is marked"
        kind, a = self.op
        assert a["use_padding_mask"] and a["diagonal_band_right_bound"] == 0 and a["diagonal_alignment"] == "TOP_LEFT"
        assert a["seq_len_q"] is not a["seq_len_kv"] and torch.equal(pack[a["seq_len_q"]], pack[a["seq_len_kv"]])
        lengths = pack[a["seq_len_q"]].flatten().tolist()
        m, H, s, d = a["q"].dim
        assert len(lengths) == m and max(lengths) <= s and all(n >= 0 for n in lengths)
        self.executed += 1

        def doc(node: Node, i: int) -> torch.Tensor:
            """Document i of a ragged [m, heads, s, d] tensor: [its length, heads, d] at its offset, by its strides."""
            buffer, offsets = pack[node], pack[node.ragged].flatten()
            assert node.ragged is not None and node.dim[0] == m and node.stride[-1] == 1 and buffer.is_contiguous()
            heads, dd = node.dim[1], node.dim[3]
            return buffer.as_strided((lengths[i], heads, dd), (node.stride[2], node.stride[1], 1),
                                     buffer.storage_offset() + int(offsets[i]))

        def attend(q_LHd: torch.Tensor, k_Lhd: torch.Tensor, v_Lhd: torch.Tensor) -> tuple[torch.Tensor, ...]:
            """Causal attention with GQA: output, log-sum-exp and the probabilities, in fp32."""
            group = q_LHd.shape[1] // k_Lhd.shape[1]
            k_LHd, v_LHd = (x.repeat_interleave(group, dim=1) for x in (k_Lhd, v_Lhd))
            scores_HLL = torch.einsum("qhd,khd->hqk", q_LHd, k_LHd) * a["attn_scale"]
            scores_HLL = scores_HLL.masked_fill(~torch.ones_like(scores_HLL, dtype=torch.bool).tril(), -torch.inf)
            lse_HL = scores_HLL.logsumexp(-1)
            p_HLL = (scores_HLL - lse_HL[..., None]).exp()
            return torch.einsum("hqk,khd->qhd", p_HLL, v_LHd), lse_HL.T, p_HLL, k_LHd, v_LHd, group

        for i in range(m):
            if lengths[i] == 0:
                continue
            q, k, v = (doc(a[x], i).float() for x in "qkv")
            o, lse, p, k_LHd, v_LHd, group = attend(q, k, v)
            if kind == "sdpa":
                assert a["generate_stats"]
                doc(self.outputs[0], i).copy_(o)
                doc(self.outputs[1], i)[..., 0].copy_(lse)
                continue
            assert a["max_total_seq_len_q"] % 64 == 0 and a["max_total_seq_len_q"] >= pack[a["q"]].shape[0]
            # the forward's output and statistics, bound to the backward's graph, are this document's
            torch.testing.assert_close(doc(a["o"], i).float(), o, rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(doc(a["stats"], i)[..., 0], lse, rtol=1e-4, atol=1e-4)
            # softmax attention's backward (a custom op's backward runs below autograd): dV = P^T dO,
            # dS = P (dO V^T - rowsum(dO o)), dQ = dS K scale, dK = dS^T Q scale; GQA sums each group's heads
            do = doc(a["dO"], i).float()
            dp_HLL = torch.einsum("qhd,khd->hqk", do, v_LHd)
            ds_HLL = p * (dp_HLL - (do * o).sum(-1).T[..., None]) * a["attn_scale"]
            dq = torch.einsum("hqk,khd->qhd", ds_HLL, k_LHd)
            dk = torch.einsum("hqk,qhd->khd", ds_HLL, q)
            dv = torch.einsum("hqk,qhd->khd", p, do)
            for node, grad in zip(self.outputs, (dq, *(x.unflatten(1, (-1, group)).sum(2) for x in (dk, dv)))):
                doc(node, i).copy_(grad)


def fake_cudnn() -> types.ModuleType:
    module = types.ModuleType("cudnn")
    module.data_type = types.SimpleNamespace(HALF="HALF", BFLOAT16="BFLOAT16", FLOAT="FLOAT", INT32="INT32",
                                             INT64="INT64")
    module.heur_mode = types.SimpleNamespace(A="A", FALLBACK="FALLBACK")
    module.diagonal_alignment = types.SimpleNamespace(TOP_LEFT="TOP_LEFT")
    module.graphs = []

    def pygraph(**kwargs: Any) -> Graph:
        module.graphs.append(Graph(**kwargs))
        return module.graphs[-1]

    module.pygraph = pygraph
    module.set_stream = lambda handle, stream: None
    return module


@pytest.fixture
def cudnn_on_cpu(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """GLUE: the interpreter as ``cudnn``, one handle, stream 0 and no device switch (CPU tensors have no CUDA
    stream or device); fresh graph caches before and after."""
    module = fake_cudnn()
    monkeypatch.setitem(sys.modules, "cudnn", module)
    monkeypatch.setattr(cudnn_attention, "_handle", lambda index: "handle")
    monkeypatch.setattr(cudnn_attention, "_stream", lambda dev: 0)
    monkeypatch.setattr(cudnn_attention, "_device", lambda dev: contextlib.nullcontext())
    cudnn_attention._graph.cache_clear()
    yield module
    cudnn_attention._graph.cache_clear()


@pytest.mark.parametrize("heads", [(4, 2, 16), (4, 4, 8)], ids=["gqa", "mha"])
def test_path_equals_dense_mask_and_documents_alone(cudnn_on_cpu, heads) -> None:
    """bf16 through the whole path against the fp32 dense mask and every document alone, in the model's
    [B, T, heads, d] memory layout; 7 documents in a 16-document graph (9 empty), the longest the row."""
    H, h, d = heads
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(2, T, n, d, generator=gen).bfloat16().transpose(1, 2) for n in (H, h, h)]
    ids_BT = document_ids(position_ids(LENGTHS))
    attention = CudnnAttention()
    got = out_and_grads(attention, attention.documents(ids_BT), tensors)
    fp32 = [x.float() for x in tensors]
    want = out_and_grads(DenseMaskAttention(), DenseMaskAttention().documents(ids_BT), fp32)
    for g, w, what in zip(got, want, ("out", "dq", "dk", "dv")):
        assert g.dtype == torch.bfloat16 and g.shape == w.shape
        assert ((g.float() - w).norm() / w.norm()).item() < 1e-2, what
    if (H, h, d) == (4, 2, 16):  # each_document_alone's heads
        for g, a in zip(got, each_document_alone(fp32)):
            assert ((g.float() - a).norm() / a.norm()).item() < 1e-2
    forward, backward = cudnn_on_cpu.graphs  # one of each, built once, for 16 documents of at most 300 tokens
    assert forward.op[0] == "sdpa" and backward.op[0] == "sdpa_backward"
    assert forward.op[1]["q"].dim == [16, H, 300, d] and forward.op[1]["k"].dim == [16, h, 300, d]
    assert forward.io_data_type == "BFLOAT16" and forward.compute_data_type == "FLOAT"


def test_graphs_are_reused_per_bucket_and_compile(cudnn_on_cpu) -> None:
    """Batches of the same buckets reuse the graphs (a new bucket builds a pair); under torch.compile(fullgraph)
    the op is one opaque node and gives the eager values."""
    attention, (q, k, v) = CudnnAttention(), [x.bfloat16() for x in qkv()]
    first = attention.documents(document_ids(position_ids(LENGTHS)))
    other = attention.documents(document_ids(position_ids([[3, 297], [150, 150]])))  # 4 documents: still 16
    longer = attention.documents(_ids([[1] * 40 + [260], [300]]))  # 42 documents: a 64-document bucket
    eager = [attention(q, k, v, docs, 0.25) for docs in (first, other, first, longer)]
    assert len(cudnn_on_cpu.graphs) == 1 + 1  # forwards only so far: 16 and 64 documents
    compiled = torch.compile(lambda q, k, v, docs: attention(q, k, v, docs, 0.25), fullgraph=True,
                             backend="aot_eager")
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = compiled(*leaves, first)
    torch.testing.assert_close(out, eager[0])
    out.float().square().sum().backward()
    assert all(x.grad is not None and x.grad.abs().sum() > 0 for x in leaves)
    assert [g.op[0] for g in cudnn_on_cpu.graphs] == ["sdpa", "sdpa", "sdpa_backward"]
    assert sum(g.executed for g in cudnn_on_cpu.graphs) == 4 + 1 + 1


def test_a_graph_cudnn_refuses_fails_in_one_line_naming_the_fix(cudnn_on_cpu, monkeypatch) -> None:
    def refuse(self) -> None:
        raise RuntimeError("[cudnn_frontend] Error: No valid engine configs for SDPA_BWD")

    monkeypatch.setattr(Graph, "check_support", refuse)
    attention, (q, k, v) = CudnnAttention(), [x.bfloat16() for x in qkv()]
    with pytest.raises(RuntimeError, match=r"cuDNN cannot build the ragged attention forward for 16 documents of "
                                           r"<= 300 tokens, 4/2 heads of 16: .*No valid engine.*; fix: "
                                           r"kernel_config\.attention=varlen_attn"):
        attention(q, k, v, attention.documents(document_ids(position_ids(LENGTHS))), 0.25)


@pytest.mark.parametrize("family", FAMILIES)
def test_models_train_like_the_dense_mask(cudnn_on_cpu, family: str) -> None:
    """Both families in bf16 (cuDNN's dtypes) through the path, Qwen3.5's gated, partially rotated queries and
    DeltaNet beside it, padding and an untrained prompt: loss and every gradient as close to the fp32 dense-mask
    model as the bf16 dense-mask model is (bf16's own rounding is the yardstick)."""
    fp32 = tiny_model(family)
    exact = loss_and_grads(copy.deepcopy(fp32))
    dense = loss_and_grads(copy.deepcopy(fp32).bfloat16())
    model = use_attention(copy.deepcopy(fp32).bfloat16(), CudnnAttention())
    got = loss_and_grads(model)
    names = ["loss", *(n for n, _ in fp32.named_parameters())]
    for g, b, e, what in zip(got, dense, exact, names):
        error, bf16_error = ((x.float() - e).norm() / e.norm() for x in (g, b))
        assert error <= 1.5 * bf16_error + 2e-3, f"{what}: {error:.4f} vs the bf16 dense mask's {bf16_error:.4f}"
    assert sum(g.executed for g in cudnn_on_cpu.graphs) == 2 * (sum(
        hasattr(layer, "self_attn") for layer in model.model.layers))  # every attention layer's fwd and bwd


def test_op_takes_any_layout_and_its_lse_is_not_differentiable(cudnn_on_cpu) -> None:
    """The op copies what its graphs' strides do not describe (a head-sliced view here) and gives the contiguous
    input's values; the log-sum-exp it returns is the backward's input, marked non-differentiable."""
    gen = torch.Generator().manual_seed(1)
    q_full = torch.randn(600, 6, 16, generator=gen).bfloat16()
    q_view, k = q_full[:, 1:5], torch.randn(600, 2, 16, generator=gen).bfloat16()
    cu_m1 = ragged_documents(document_cu_seqlens(document_ids(position_ids(LENGTHS))), 300, T).cu_seqlens_m1
    op = torch.ops.qwen_moe.cudnn_document_attention
    assert not q_view.is_contiguous()
    strided, lse = op(q_view.requires_grad_(), k, k, cu_m1, 300, 0.25)
    torch.testing.assert_close(strided, op(q_view.contiguous(), k, k, cu_m1, 300, 0.25)[0], rtol=0, atol=0)
    assert strided.requires_grad and not lse.requires_grad


def test_documents_of_another_kernel_are_refused(cudnn_on_cpu) -> None:
    attention, (q, k, v) = CudnnAttention(), [x.bfloat16() for x in qkv()]
    other = DenseMaskAttention().documents(document_ids(position_ids(LENGTHS)))
    with pytest.raises(ValueError, match=r"documents built by another kernel: build them with its own documents"):
        attention(q, k, v, other, 0.25)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the real cuDNN kernel)")
def test_cuda_kernel_writes_only_the_documents_rows() -> None:
    """cuDNN writes o and the ragged log-sum-exp only inside the documents: rows past the last one (where the
    empty padding documents point) stay as they were, and the values equal the fp32 dense mask's."""
    from kernels.registry import select_kernels
    from kernels.config import KernelConfig

    try:
        select_kernels(KernelConfig(attention="cudnn_attention"), "cuda")
    except ValueError as error:
        pytest.skip(str(error))
    gen = torch.Generator().manual_seed(2)
    N, guard, (H, h, d) = 2 * T, 64, (16, 2, 256)
    q, k, v = (torch.randn(N, n, d, generator=gen).cuda().bfloat16() for n in (H, h, h))
    o_full = torch.full((N + guard, H, d), 7.0, device="cuda", dtype=torch.bfloat16)
    lse_full = torch.full((N + guard, H), 7.0, device="cuda")
    ids_BT = document_ids(position_ids(LENGTHS)).cuda()
    cu_n1 = document_cu_seqlens(ids_BT)
    ragged = ragged_documents(cu_n1, int(cu_n1.diff().max()), T)
    cudnn_attention._run(False, {"q": q, "k": k, "v": v}, {"o": o_full[:N], "stats": lse_full[:N]},
                         ragged.cu_seqlens_m1, ragged.longest, d**-0.5)
    assert (o_full[N:] == 7.0).all() and (lse_full[N:] == 7.0).all()
    views = [x.view(2, T, -1, d).transpose(1, 2).float() for x in (q, k, v)]
    want = DenseMaskAttention()(*views, DenseMaskAttention().documents(ids_BT), d**-0.5)
    got = o_full[:N].view(2, T, H, d).transpose(1, 2).float()
    assert ((got - want).norm() / want.norm()).item() < 2e-2
