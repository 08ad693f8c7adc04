"""Packed-document attention on one GPU, forward and forward + backward, every implementation beside causal SDPA on
the same rows (``kernels/attention/attention.py``, ``kernels/attention/cudnn_attention.py``), bf16, at both families'
attention shapes:

- qwen3: 32 query heads, 4 key/value heads of 128 (Qwen3-30B-A3B);
- qwen35: 16 query heads, 2 key/value heads of 256 (Qwen3.5-35B-A3B's full-attention layers).

q, k and v are laid out as the model hands them over ([B, T, heads, d] memory seen as [B, heads, T, d], what the
projections and the rotary kernel write), so a kernel's layout copies are timed too. Documents (``--docs``):
``uniform:N`` lengths uniform in 1..N; ``fixed:N`` all N long; ``chitchat`` the first ``--windows`` batches of
the Chit-Chat corpus as the trainer packs them (``data=chitchat``, the shape's tokenizer), which is what the
packed rows of docs/results.md#packed-documents-and-long-windows train on. Times: device events, mean of 20
back-to-back runs after 3 warm-ups (``core.device.time_ms``), averaged over the batches; "attended TFLOP/s" counts
the document pairs computed (sum over documents of length^2, halved for causality), as the trainer's attended MFU;
"docs" is the per-batch cost of the implementation's ``documents`` (FlexAttention's BlockMask). ``--flex-options`` adds
FlexAttention runs with those ``kernel_options`` (JSON, one object per run, e.g. ``'{"bwd_num_warps": 8}'``),
``--flex-autotune`` one compiled with ``mode="max-autotune-no-cudagraphs"`` (inductor prints its choices).
``--profile`` lists each implementation's kernels of one forward + backward.

    python scripts/bench_attention.py [--shape qwen35] [--seq-len 4096] [--batch 4] [--docs chitchat] [--profile]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core import device  # noqa: E402
from kernels.attention.attention import (DenseMaskAttention, Documents, FlexAttention, KnownDocuments,  # noqa: E402
                               VarlenAttention, causal_sdpa, document_cu_seqlens)
from kernels.attention.cudnn_attention import CudnnAttention  # noqa: E402
from scripts.bench_deltanet import packed_rows  # noqa: E402

SHAPES = {"qwen3": (32, 4, 128), "qwen35": (16, 2, 256)}
TOKENIZERS = {"qwen3": "qwen3", "qwen35": "qwen3_5"}


def synthetic_ids(B: int, T: int, spec: str, gen: torch.Generator) -> torch.Tensor:
    """Document ids [B, T] (every row starting a document) for ``uniform:N`` or ``fixed:N``."""
    kind, _, n = spec.partition(":")
    if kind not in ("uniform", "fixed") or not n.isdigit() or int(n) < 1:
        raise SystemExit(f"--docs {spec!r}: expected uniform:N, fixed:N or chitchat (N >= 1)")
    lengths_n = (torch.full((B * T,), int(n)) if kind == "fixed"
                 else torch.randint(1, int(n) + 1, (B * T,), generator=gen))
    return packed_rows(lengths_n, B, T)[0]


def chitchat_ids(B: int, T: int, shape: str, windows: int) -> list[torch.Tensor]:
    """The document ids of the first ``windows`` batches the trainer packs from chitchat (seed 0)."""
    from models.layers import document_ids
    from training.data.config import DataConfig
    from training.data.loader import build_data_loader

    loader = build_data_loader(DataConfig(name="chitchat", seq_len=T), seed=0, local_batch_size=B, dp_rank=0,
                               dp_size=1, tokenizer=TOKENIZERS[shape])
    return [document_ids(next(loader)["position_ids"], packed=True) for _ in range(windows)]


def attended_flops(cu_n1: torch.Tensor, H: int, d: int, backward: bool) -> float:
    """Forward: 2 GEMMs of 2 FLOPs per (query, key, dim) over the causal pairs of every document; backward 2.5x."""
    lengths = cu_n1.diff().double()
    pairs = float((lengths * (lengths + 1) / 2).sum())
    return 4 * pairs * H * d * (3.5 if backward else 1.0)


@functools.cache
def _flex(mode: str | None) -> Callable[..., torch.Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False, mode=mode)


class TunedFlex(FlexAttention):
    """FlexAttention with explicit ``kernel_options`` or a compile mode (what the bench compares)."""

    def __init__(self, options: dict | None = None, mode: str | None = None) -> None:
        super().__init__()
        self.options, self.mode = options, mode

    def __call__(self, q, k, v, docs, scale):  # noqa: ANN001, ANN204 -- FlexAttention's signature
        return _flex(self.mode)(q, k, v, block_mask=docs.block_mask, scale=scale, enable_gqa=True,
                                kernel_options=self.options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen35")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--docs", default="uniform:400", help="uniform:N | fixed:N | chitchat")
    parser.add_argument("--windows", type=int, default=4, help="--docs chitchat: batches timed (averaged)")
    parser.add_argument("--flex-options", nargs="*", default=[], help="extra FlexAttention runs' kernel_options")
    parser.add_argument("--flex-autotune", action="store_true", help="add FlexAttention under max-autotune")
    parser.add_argument("--profile", action="store_true", help="list the kernels of one forward + backward")
    args = parser.parse_args()
    if args.windows < 1:
        parser.error(f"--windows {args.windows}: time at least one batch (--windows 1 or more)")
    try:
        flex_options = [json.loads(options) for options in args.flex_options]
    except json.JSONDecodeError as error:
        parser.error(f"--flex-options: each run's kernel_options is one JSON object, e.g. "
                     f"'{{\"bwd_num_warps\": 8}}' ({error})")
    if not all(isinstance(options, dict) for options in flex_options):
        parser.error("--flex-options: each run's kernel_options is one JSON object, e.g. '{\"bwd_num_warps\": 8}'")
    dev_type = device.device_type()
    if dev_type == "cpu":
        raise SystemExit("bench_attention.py times device kernels: run it where an accelerator is")
    dev = torch.device(dev_type)
    (H, h, d), B, T = SHAPES[args.shape], args.batch, args.seq_len
    gen = torch.Generator().manual_seed(0)
    batches = (chitchat_ids(B, T, args.shape, args.windows) if args.docs == "chitchat"
               else [synthetic_ids(B, T, args.docs, gen)])
    # Leaves in the model's memory layout; the kernels see the [B, heads, T, d] views.
    q_BTHd = torch.randn(B, T, H, d, generator=gen).bfloat16().to(dev).requires_grad_()
    k_BThd, v_BThd = (torch.randn(B, T, h, d, generator=gen).bfloat16().to(dev).requires_grad_() for _ in range(2))
    leaves, dy_BTHd = (q_BTHd, k_BThd, v_BThd), torch.randn_like(q_BTHd)
    scale = d**-0.5
    cus = [document_cu_seqlens(ids_BT) for ids_BT in batches]
    lengths = torch.cat([cu.diff() for cu in cus]).double()
    print(f"{args.shape}: {H}/{h} heads x {d}, {B} x {T} tokens, docs {args.docs}: {len(batches)} batch(es), "
          f"{lengths.numel() / len(batches):.1f} documents a batch (mean {lengths.mean():.0f}, median "
          f"{lengths.median():.0f}, longest {lengths.max():.0f}), attended work "
          f"{(lengths * (lengths + 1)).sum() / (len(batches) * B * T * (T + 1)):.1%} of causal; torch "
          f"{torch.__version__}")

    impls: dict[str, DenseMaskAttention | None] = {"causal sdpa (one sequence per row)": None,
                                                   "cudnn_attention (ragged)": CudnnAttention(),
                                                   "varlen_attn": VarlenAttention(),
                                                   "flex_attention (compiled)": FlexAttention()}
    for text, options in zip(args.flex_options, flex_options):
        impls[f"flex {text}"] = TunedFlex(options)
    if args.flex_autotune:
        impls["flex (max-autotune)"] = TunedFlex(mode="max-autotune-no-cudagraphs")

    causal_cu_n1 = torch.tensor([0, *range(T, B * T + 1, T)])  # one document per row

    def views() -> tuple[torch.Tensor, ...]:
        return tuple(x.transpose(1, 2) for x in leaves)

    for name, impl in impls.items():
        fwd = both = docs_ms = flops_f = flops_b = 0.0
        try:
            for ids_BT, cu in zip(batches, cus):
                if impl is None:
                    call, cu = (lambda: causal_sdpa(*views(), scale)), causal_cu_n1
                else:
                    ids_dev = ids_BT.to(dev)
                    known = KnownDocuments(cu.to(dev), cu)
                    docs_ms += device.time_ms(dev_type, lambda: impl.documents(ids_dev, known), iters=5)
                    docs: Documents = impl.documents(ids_dev, known)
                    call = lambda impl=impl, docs=docs: impl(*views(), docs, scale)  # noqa: E731
                fwd += device.time_ms(dev_type, call)
                both += device.time_ms(dev_type, lambda call=call: torch.autograd.grad(
                    call().transpose(1, 2), leaves, dy_BTHd))
                flops_f += attended_flops(cu, H, d, False)
                flops_b += attended_flops(cu, H, d, True)
        except Exception as error:  # noqa: BLE001 -- a kernel that cannot run here is one line of the table
            print(f"{name:36s} cannot run: {type(error).__name__}: {str(error).splitlines()[0][:160]}")
            continue
        n = len(batches)
        print(f"{name:36s} fwd {fwd / n:7.3f} ms ({flops_f / fwd / 1e9:5.0f} attended TFLOP/s)   "
              f"fwd+bwd {both / n:7.3f} ms ({flops_b / both / 1e9:5.0f})   docs {docs_ms / n:6.3f} ms")
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                torch.autograd.grad(call().transpose(1, 2), leaves, dy_BTHd)
                device.module(dev_type).synchronize()
            print(prof.key_averages().table(sort_by="device_time_total", row_limit=12, max_name_column_width=90))
        device.module(dev_type).empty_cache()


if __name__ == "__main__":
    main()
