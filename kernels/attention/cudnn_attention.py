"""Document-causal attention on cuDNN's ragged SDPA (``document_attention``'s ``cudnn_attention`` kernel, CUDA, sm_90
and newer), through cudnn-frontend's Python graphs (``pip install '.[gpu]'``, imported where used).

The packed batch is the flattened [B*T, heads, d] tokens the projections wrote, seen as a batch of n variable-length
sequences: each tensor's ragged offsets (document starts x heads x d) say where a document begins, ``seq_len`` how
long it is, and the kernel's causal band is bounded by each document, so nothing is padded or masked per pair and
nothing is copied where the tensors are in the projections' own layout. GQA is cuDNN's own (h key/value heads for
H query heads). On an H200 (torch 2.11, cuDNN 9.19; docs/results.md#kernels-alone, row 33) these graphs ran fwd + bwd
at 1.2-1.6x the speed of torch's varlen flash (FA2) on 4k windows of short documents and on 32k windows of
2,048-token ones, head dims 128 and 256; this module's path has not yet trained on a GPU, so the registry takes it
only where named (``kernel_config.attention=cudnn_attention``).

Why not torch's own cuDNN path (``_cudnn_attention_forward`` with ``cum_seq_q``, what nested tensors take): on torch
2.11 its backward sizes cuDNN's dQ accumulator from the head dim instead of the longest document and corrupts the
gradients (pytorch#186142); the frontend builds the graph itself.

A graph is built per (documents, longest document, heads, head dim, tokens, scale) and reused: the document count
is rounded up to a power of two (the extra documents are empty, at the end) and the longest document to a power of
two (at most the row), so a run builds a handful of graph pairs (0.1-2.5 s each, measured), each at the first batch
of its bucket (so the ranks of a job may build at different steps).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import torch

from kernels.attention.attention import (DenseMaskAttention, Documents, KnownDocuments, causal_sdpa,
                                        documents_with_longest)

Tensor = torch.Tensor
MIN_DOCUMENTS = 16  # the smallest document-count bucket
MIN_LONGEST = 128  # the smallest longest-document bucket (one of cuDNN's tiles)
DTYPES = (torch.bfloat16, torch.float16)
_NAMESPACE = "qwen_moe"


class Ragged(NamedTuple):
    """A batch's documents as cuDNN's graphs take them (``CudnnAttention.documents``)."""

    cu_seqlens_m1: Tensor  # int64 [m + 1]: cu_seqlens, then m - n empty documents at the end (m: the bucket)
    longest: int  # the graph's sequence bound: the longest document rounded up to a power of two, at most T


def _bucket(x: int, floor: int) -> int:
    return max(floor, 1 << (x - 1).bit_length())


def ragged_documents(cu_seqlens_n1: Tensor, max_len: int, T: int) -> Ragged:
    """Pad ``cu_seqlens`` to a power-of-two count of documents with empty ones, round the longest up likewise (at
    most the row length ``T``): the key of the graph the batch reuses. No device read."""
    n = cu_seqlens_n1.numel() - 1
    m = _bucket(n, MIN_DOCUMENTS)
    cu_n1 = cu_seqlens_n1.to(torch.int64)
    cu_m1 = torch.cat([cu_n1, cu_n1[-1:].expand(m - n)])
    return Ragged(cu_m1, min(T, _bucket(max_len, MIN_LONGEST)))


@functools.cache
def _handle(device_index: int) -> Any:
    """One cuDNN handle per GPU, created (like the graphs) with that GPU current (``_device``)."""
    import cudnn

    return cudnn.create_handle()


def _stream(dev: torch.device) -> int:
    """The raw stream the graphs run on: the current one, where torch's own kernels of the step run."""
    return torch.cuda.current_stream(dev).cuda_stream


class _Graph(NamedTuple):
    graph: Any
    tensors: dict[str, Any]


def _device(dev: torch.device) -> Any:
    """The graphs are built and run with the tensors' GPU current (cuDNN loads its kernels on the current one)."""
    return torch.cuda.device(dev)


@functools.cache  # a few (document-count, longest) buckets a run; a pair of graphs is ~a plan each, kept
def _graph(backward: bool, m: int, s: int, H: int, h: int, d: int, N: int, scale: float, half: bool,
           device_index: int) -> _Graph:
    """The forward or backward graph of m documents of at most s tokens in [N = B*T, heads, d] (N: the backward's
    bound on the tokens; 0 for the forward, which does not depend on it)."""
    import cudnn

    dt = cudnn.data_type
    io = dt.HALF if half else dt.BFLOAT16
    g = cudnn.pygraph(io_data_type=io, intermediate_data_type=dt.FLOAT, compute_data_type=dt.FLOAT,
                      handle=_handle(device_index))
    t: dict[str, Any] = {}
    for name in ("off_q", "off_kv", "off_stats"):  # element offsets of each document's first token
        t[name] = g.tensor(name=name, dim=[m + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dt.INT64)
    for name in ("lengths_q", "lengths_kv"):  # every document's length (0 for the bucket's empty ones), twice
        t[name] = g.tensor(name=name, dim=[m, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dt.INT32)
    # [documents, heads, tokens, d] over the [N, heads, d] memory: token-major, each document at its offset
    q_dims, q_strides = [m, H, s, d], [s * H * d, d, H * d, 1]
    kv_dims, kv_strides = [m, h, s, d], [s * h * d, d, h * d, 1]
    stats_dims, stats_strides = [m, H, s, 1], [s * H, 1, H, 1]  # fp32 [N, H]: log-sum-exp per token and head

    def ragged(name: str, dims: list[int], strides: list[int], offsets: str, data_type: Any = io) -> Any:
        t[name] = g.tensor(name=name, dim=dims, stride=strides, data_type=data_type)
        t[name].set_ragged_offset(t[offsets])
        return t[name]

    q, k, v = (ragged("q", q_dims, q_strides, "off_q"), ragged("k", kv_dims, kv_strides, "off_kv"),
               ragged("v", kv_dims, kv_strides, "off_kv"))
    # causal within each document: the band's right bound on the diagonal, from each document's first token
    mask = dict(attn_scale=scale, use_padding_mask=True, seq_len_q=t["lengths_q"], seq_len_kv=t["lengths_kv"],
                diagonal_band_right_bound=0, diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT)
    if not backward:
        o, stats = g.sdpa(name="sdpa", q=q, k=k, v=v, generate_stats=True, **mask)
        o.set_output(True).set_dim(q_dims).set_stride(q_strides).set_ragged_offset(t["off_q"])
        stats.set_output(True).set_data_type(dt.FLOAT).set_dim(stats_dims).set_stride(stats_strides)
        stats.set_ragged_offset(t["off_stats"])
        t["o"], t["stats"] = o, stats
    else:
        o, do = ragged("o", q_dims, q_strides, "off_q"), ragged("do", q_dims, q_strides, "off_q")
        stats = ragged("stats", stats_dims, stats_strides, "off_stats", dt.FLOAT)
        total = -(-N // 64) * 64  # the ragged backward's bound on the tokens, a multiple of 64
        dq, dk, dv = g.sdpa_backward(name="sdpa_backward", q=q, k=k, v=v, o=o, dO=do, stats=stats,
                                     max_total_seq_len_q=total, max_total_seq_len_kv=total, **mask)
        for x, name, dims, strides, offsets in ((dq, "dq", q_dims, q_strides, "off_q"),
                                                (dk, "dk", kv_dims, kv_strides, "off_kv"),
                                                (dv, "dv", kv_dims, kv_strides, "off_kv")):
            x.set_output(True).set_dim(dims).set_stride(strides).set_ragged_offset(t[offsets])
            t[name] = x
    try:
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
    except Exception as error:  # cuDNN's own message, in one line that names the fix
        raise RuntimeError(f"cuDNN cannot build the ragged attention {'backward' if backward else 'forward'} for "
                           f"{m} documents of <= {s} tokens, {H}/{h} heads of {d}: {error}; fix: "
                           "kernel_config.attention=varlen_attn") from error
    return _Graph(g, t)


def _run(backward: bool, inputs: dict[str, Tensor], outputs: dict[str, Tensor], cu_m1: Tensor, s: int,
         scale: float) -> None:
    """Run the graph on ``inputs`` (copied first where not contiguous: the graphs' strides describe contiguous
    [N, heads, d] and [N, H] memory) into the contiguous ``outputs``."""
    import cudnn

    assert all(x.is_contiguous() for x in outputs.values())
    q = inputs["q"]
    N, H, d = q.shape
    h = inputs["k"].shape[1]
    m = cu_m1.numel() - 1
    with _device(q.device):
        graph, tensors = _graph(backward, m, s, H, h, d, N if backward else 0, scale, q.dtype == torch.float16,
                                q.device.index)
        lengths_m = cu_m1.diff().to(torch.int32)
        buffers = {name: x.contiguous() for name, x in inputs.items()} | outputs | {
            "off_q": cu_m1 * (H * d), "off_kv": cu_m1 * (h * d), "off_stats": cu_m1 * H, "lengths_q": lengths_m,
            "lengths_kv": lengths_m}
        workspace = torch.empty(graph.get_workspace_size(), device=q.device, dtype=torch.uint8)
        handle = _handle(q.device.index)
        cudnn.set_stream(handle=handle, stream=_stream(q.device))
        graph.execute({tensors[name]: x for name, x in buffers.items()}, workspace, handle=handle)


def _empty(like: Tensor) -> Tensor:
    """A contiguous tensor of ``like``'s shape (an output the graphs write, whatever the input's strides)."""
    return torch.empty(like.shape, dtype=like.dtype, device=like.device)


@torch.library.custom_op(f"{_NAMESPACE}::cudnn_document_attention", mutates_args=())
def cudnn_document_attention(q_NHd: Tensor, k_Nhd: Tensor, v_Nhd: Tensor, cu_seqlens_m1: Tensor, longest: int,
                             scale: float) -> tuple[Tensor, Tensor]:
    """Causal attention within each document of the flattened tokens: (o [N, H, d], log-sum-exp [N, H] fp32)."""
    o_NHd = _empty(q_NHd)
    lse_NH = q_NHd.new_empty(q_NHd.shape[:2], dtype=torch.float32)
    _run(False, {"q": q_NHd, "k": k_Nhd, "v": v_Nhd}, {"o": o_NHd, "stats": lse_NH}, cu_seqlens_m1, longest, scale)
    return o_NHd, lse_NH


@cudnn_document_attention.register_fake
def _(q_NHd, k_Nhd, v_Nhd, cu_seqlens_m1, longest, scale):  # noqa: ANN001, ANN202
    return _empty(q_NHd), q_NHd.new_empty(q_NHd.shape[:2], dtype=torch.float32)


@torch.library.custom_op(f"{_NAMESPACE}::cudnn_document_attention_backward", mutates_args=())
def cudnn_document_attention_backward(do_NHd: Tensor, q_NHd: Tensor, k_Nhd: Tensor, v_Nhd: Tensor, o_NHd: Tensor,
                                      lse_NH: Tensor, cu_seqlens_m1: Tensor, longest: int,
                                      scale: float) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = _empty(q_NHd), _empty(k_Nhd), _empty(v_Nhd)
    _run(True, {"q": q_NHd, "k": k_Nhd, "v": v_Nhd, "o": o_NHd, "do": do_NHd, "stats": lse_NH},
         {"dq": dq, "dk": dk, "dv": dv}, cu_seqlens_m1, longest, scale)
    return dq, dk, dv


@cudnn_document_attention_backward.register_fake
def _(do_NHd, q_NHd, k_Nhd, v_Nhd, o_NHd, lse_NH, cu_seqlens_m1, longest, scale):  # noqa: ANN001, ANN202
    return _empty(q_NHd), _empty(k_Nhd), _empty(v_Nhd)


def _setup_context(ctx, inputs, output) -> None:  # noqa: ANN001
    q_NHd, k_Nhd, v_Nhd, cu_seqlens_m1, longest, scale = inputs
    ctx.save_for_backward(q_NHd, k_Nhd, v_Nhd, output[0], output[1], cu_seqlens_m1)
    ctx.longest, ctx.scale = longest, scale
    ctx.mark_non_differentiable(output[1])  # the log-sum-exp is the backward's input, not a differentiable output


def _backward(ctx, do_NHd: Tensor, _lse_grad: Tensor | None):  # noqa: ANN001, ANN202 -- lse: non-differentiable
    q_NHd, k_Nhd, v_Nhd, o_NHd, lse_NH, cu_seqlens_m1 = ctx.saved_tensors
    dq, dk, dv = cudnn_document_attention_backward(do_NHd, q_NHd, k_Nhd, v_Nhd, o_NHd, lse_NH, cu_seqlens_m1,
                                                   ctx.longest, ctx.scale)
    return dq, dk, dv, None, None, None


cudnn_document_attention.register_autograd(_backward, setup_context=_setup_context)


class CudnnAttention(DenseMaskAttention):
    """cuDNN's ragged SDPA over the documents of the flattened batch: no cross-document block is computed, no
    layout copy, GQA native; an unpacked batch (no documents) takes SDPA's causal path."""

    def documents(self, ids_BT: Tensor, known: KnownDocuments | None = None) -> Documents:
        docs = documents_with_longest(ids_BT, known)
        return dataclasses.replace(docs, ragged=ragged_documents(docs.cu_seqlens_n1, docs.max_len, ids_BT.shape[1]))

    def __call__(self, q_BHTd: Tensor, k_BhTd: Tensor, v_BhTd: Tensor, docs: Documents | None,
                 scale: float) -> Tensor:
        if docs is None:
            return causal_sdpa(q_BHTd, k_BhTd, v_BhTd, scale)
        if docs.ragged is None:
            raise ValueError("CudnnAttention got documents built by another kernel: build them with its own "
                             "documents() (the decoder does, once per batch)")
        if q_BHTd.dtype not in DTYPES:
            raise ValueError(f"kernel_config.attention=cudnn_attention runs bf16 or fp16, this attention gets "
                             f"{q_BHTd.dtype}; fix: train.mixed_precision=bf16, or kernel_config.attention=torch")
        B, H, T, d = q_BHTd.shape
        # [B, heads, T, d] views of the [B, T, heads, d] memory the projections wrote: [N, heads, d] with no copy
        q_NHd, k_Nhd, v_Nhd = (x.transpose(1, 2).reshape(B * T, x.shape[1], d) for x in (q_BHTd, k_BhTd, v_BhTd))
        o_NHd, _ = cudnn_document_attention(q_NHd, k_Nhd, v_Nhd, docs.ragged.cu_seqlens_m1, docs.ragged.longest,
                                            scale)
        return o_NHd.view(B, T, H, d).transpose(1, 2)
