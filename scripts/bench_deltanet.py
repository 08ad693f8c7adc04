"""DeltaNet's packed-document kernels on one GPU, each beside its alternative, forward + backward, at Qwen3.5-35B-A3B
shapes (conv channels 8192 = [q 2048 | k 2048 | v 4096], 4 taps; delta rule 16 q/k heads and 32 value heads of 128),
bf16, ``--batch`` rows of ``--seq-len`` tokens:

- the short convolution: ours (``kernels/linear_attention/triton_short_conv.py``) and FLA's, rows of one sequence and
  packed documents, with each one's error against the torch reference in fp32;
- the chunked delta rule over packed documents, at each of ``--delta-layouts``: FLA's variable-length launch
  (``cu_seqlens``) and its launch for the rows with every document's start reset through the decay
  (``kernels/linear_attention/fla.py``), with the difference between their outputs and gradients; the rows without
  documents for scale.

Documents: lengths uniform in 1..``--max-doc`` (about half that on average), cut at the row ends. Times: device
events, mean of 20 back-to-back runs after 3 warm-ups (``core.device.time_ms``).

    python scripts/bench_deltanet.py [--seq-len 4096] [--batch 4] [--max-doc 400] [--conv-tiles] [--delta-layouts 4x4096,1x16384]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core import device  # noqa: E402
from kernels.attention.attention import Documents  # noqa: E402
from kernels.linear_attention import fla, short_conv  # noqa: E402

CONV_CHANNELS, TAPS, QK_HEADS, V_HEADS, HEAD_DIM = 8192, 4, 16, 32, 128


def packed_rows(lengths_n: torch.Tensor, B: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Documents of ``lengths_n`` (host) packed into B rows of T, cut at the rows' ends (every row starts a
    document): each token's document id within its row [B, T] and the flattened offsets (``cu_seqlens``), on the
    host."""
    starts = torch.cat([torch.tensor([0]), lengths_n.cumsum(0)])
    starts = torch.cat([starts[starts < B * T], torch.arange(T, B * T, T)]).unique()
    ids_BT = torch.zeros(B * T, dtype=torch.long).index_fill_(0, starts, 1).view(B, T).cumsum(1) - 1
    return ids_BT, torch.cat([starts, torch.tensor([B * T])])


def packed_documents(B: int, T: int, max_doc: int, gen: torch.Generator, dev: torch.device) -> Documents:
    """Documents of 1..max_doc tokens packed into B rows of T; the offsets known on the host, as the trainer's."""
    ids_BT, cu_n1 = packed_rows(torch.randint(1, max_doc + 1, (B * T,), generator=gen), B, T)
    return Documents(ids_BT.to(dev), cu_n1.to(dev), host_cu_seqlens_n1=cu_n1)


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def forward_backward(fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor], dy: torch.Tensor) -> list[torch.Tensor]:
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*leaves)
    return [out, *torch.autograd.grad(out, [t for t in leaves if t.requires_grad], dy.to(out.dtype))]


def timed(dev_type: str, fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor], dy: torch.Tensor) -> float:
    return device.time_ms(dev_type, lambda: forward_backward(fn, inputs, dy))


def bench_conv(dev_type: str, gen: torch.Generator, dev: torch.device, B: int, T: int, docs: Documents,
               tiles: bool) -> None:
    from kernels.linear_attention import triton_short_conv  # Triton: imported only where it runs

    x = torch.randn(B, T, CONV_CHANNELS, generator=gen, device=dev).bfloat16()
    w = (torch.randn(CONV_CHANNELS, TAPS, generator=gen, device=dev) * 0.5).bfloat16()
    dy = torch.randn(B, T, CONV_CHANNELS, generator=gen, device=dev)
    impls = {"ours (triton)": triton_short_conv.causal_conv1d_silu, "FLA": fla.causal_conv1d_silu()}
    for name, layout in (("one sequence per row", None), ("packed documents", docs)):
        ref = forward_backward(lambda x_, w_: short_conv.causal_conv1d_silu(x_, w_, layout), [x.float(), w.float()], dy)
        for impl, fn in impls.items():
            got = forward_backward(lambda x_, w_: fn(x_, w_, layout), [x, w], dy)
            errors = ", ".join(f"{n} {rel(g, r):.1e}" for n, g, r in zip(("out", "dx", "dw"), got, ref))
            ms = timed(dev_type, lambda x_, w_: fn(x_, w_, layout), [x, w], dy)
            print(f"conv  {name:22s} {impl:14s} {ms:7.3f} ms fwd+bwd   rel. error vs fp32 torch: {errors}")
    if tiles:  # each direction's tile in turn, the other at its default
        fn, default = triton_short_conv.causal_conv1d_silu, (triton_short_conv.FWD_TILE, triton_short_conv.BWD_TILE)
        fwd_tiles = [(64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 128, 8), (32, 128, 4), (64, 256, 8)]
        bwd_tiles = [(64, 32, 4), (64, 64, 4), (64, 128, 4), (64, 128, 8), (32, 128, 4), (128, 64, 8)]
        for fwd, bwd in [(t, default[1]) for t in fwd_tiles] + [(default[0], t) for t in bwd_tiles]:
            triton_short_conv.FWD_TILE, triton_short_conv.BWD_TILE = fwd, bwd
            times = [device.time_ms(dev_type, lambda: fn(x, w, layout)) for layout in (None, docs)]
            times += [timed(dev_type, lambda x_, w_: fn(x_, w_, layout), [x, w], dy) for layout in (None, docs)]
            print(f"conv tiles fwd {fwd} bwd {bwd}: fwd {times[0]:.3f} / packed {times[1]:.3f} ms, "
                  f"fwd+bwd {times[2]:.3f} / packed {times[3]:.3f} ms")
        triton_short_conv.FWD_TILE, triton_short_conv.BWD_TILE = default


def bench_delta_rule(dev_type: str, gen: torch.Generator, dev: torch.device, B: int, T: int,
                     docs: Documents) -> None:
    """FLA's two launches over the same packed rows (``kernels/linear_attention/fla.py``: the reset launch from
    RESET_MIN_ROWS rows)."""
    import triton

    capability = tuple(device.module(dev_type).get_device_capability())
    broken = fla.chunk_backward_broken(triton.__version__, capability)
    rule = (fla.chunk_gated_delta_rule_hopper_safe if broken else fla.chunk_gated_delta_rule)(64)
    q, k = (torch.randn(B, T, QK_HEADS, HEAD_DIM, generator=gen, device=dev).bfloat16() for _ in range(2))
    v = torch.randn(B, T, V_HEADS, HEAD_DIM, generator=gen, device=dev).bfloat16()
    a = torch.randn(B, T, V_HEADS, generator=gen, device=dev)
    # as the model: g = -exp(A_log) * softplus(a + dt_bias) in fp32, exp(A_log) = U(0.01, 16) per head
    g = -torch.empty(V_HEADS, device=dev).uniform_(0.01, 16, generator=gen) * F.softplus(a + 1.0)
    beta = torch.rand(B, T, V_HEADS, generator=gen, device=dev).bfloat16()
    dy = torch.randn(B, T, V_HEADS, HEAD_DIM, generator=gen, device=dev)
    inputs, chosen = [q, k, v, g, beta], fla.RESET_MIN_ROWS

    def launch(min_rows: int) -> Callable[..., torch.Tensor]:
        def fn(*t: torch.Tensor) -> torch.Tensor:
            fla.RESET_MIN_ROWS = min_rows
            return rule(*t[:3], g=t[3], beta=t[4], use_qk_l2norm_in_kernel=True, cu_seqlens=docs.cu_seqlens_n1,
                        cu_seqlens_cpu=docs.host_cu_seqlens_n1)[0]
        return fn

    varlen, reset = launch(B + 1), launch(B)
    want, got = forward_backward(varlen, inputs, dy), forward_backward(reset, inputs, dy)
    errors = ", ".join(f"{n} {rel(x, y):.1e}" for n, x, y in zip(("out", "dq", "dk", "dv", "dg", "dbeta"), got, want))
    chunks = len(fla.host_chunk_indices(docs.host_cu_seqlens_n1, 64, dev))
    times = [timed(dev_type, fn, inputs, dy) for fn in (varlen, reset)]
    times.append(timed(dev_type, lambda *t: rule(*t[:3], g=t[3], beta=t[4], use_qk_l2norm_in_kernel=True)[0],
                       inputs, dy))
    fla.RESET_MIN_ROWS = chosen
    print(f"delta {B} x {T}: varlen ({chunks} chunks) {times[0]:.3f} ms, decay reset ({B * T // 64} chunks) "
          f"{times[1]:.3f} ms fwd+bwd; rows without documents {times[2]:.3f} ms; reset vs varlen rel. difference: "
          f"{errors}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--max-doc", type=int, default=400, help="document lengths: uniform in 1..max-doc")
    parser.add_argument("--conv-tiles", action="store_true", help="also time our convolution at other tiles")
    parser.add_argument("--delta-layouts", default="4x4096,2x8192,1x16384,8x2048",
                        help="rows x tokens of the delta rule's runs (the same documents' lengths)")
    args = parser.parse_args(argv)
    dev_type = device.device_type("auto")
    if dev_type != "cuda":
        print(f"{dev_type}: these are CUDA kernels (Triton, FLA); nothing to time")
        return 0
    dev = device.local_device(dev_type)
    gen = torch.Generator(device=dev).manual_seed(0)
    docs = packed_documents(args.batch, args.seq_len, args.max_doc, torch.Generator().manual_seed(0), dev)
    n_docs = len(docs.host_cu_seqlens_n1) - 1
    print(f"{device.module(dev_type).get_device_name()}, torch {torch.__version__}; {args.batch} x {args.seq_len} tokens, "
          f"{n_docs} documents (mean {args.batch * args.seq_len / n_docs:.0f} tokens)")
    bench_conv(dev_type, gen, dev, args.batch, args.seq_len, docs, args.conv_tiles)
    for layout in args.delta_layouts.split(","):
        B, T = map(int, layout.split("x"))
        layout_docs = packed_documents(B, T, args.max_doc, torch.Generator().manual_seed(0), dev)
        bench_delta_rule(dev_type, gen, dev, B, T, layout_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
