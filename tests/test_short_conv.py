"""DeltaNet's short convolution: our Triton kernel (kernels/linear_attention/triton_short_conv.py) against the torch
reference (kernels/linear_attention/short_conv.py), output and both gradients. On CPU under Triton's interpreter
(TRITON_INTERPRET=1, fp32, in a subprocess: the interpreter is chosen at import), where triton is installed; in bf16 on
a CUDA GPU."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
_NEEDS_TRITON = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

# Rows of 70 tokens (tiles of 32 and 64 tokens in the kernels): one-token documents, documents crossing a tile,
# a row that is one document, a document of exactly one tile; 40 channels (a partial channel tile).
_CASES = """
import torch
from kernels.attention.attention import Documents, document_cu_seqlens
from kernels.linear_attention.short_conv import causal_conv1d_silu as reference
from kernels.linear_attention.triton_short_conv import causal_conv1d_silu as kernel

def run(fn, x, w, docs, dy):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(x, w, docs)
    y.backward(dy)
    return y, x.grad, w.grad

gen = torch.Generator().manual_seed(0)
B, T, F, W = 3, 70, 40, 4
rows = [[1, 1, 30, 3, 35], [70], [64, 1, 5]]
ids = torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows])
docs = Documents(ids, document_cu_seqlens(ids))
wide = torch.randn(B, T, F + 8, generator=gen)
w = torch.randn(F, W, generator=gen)
dy = torch.randn(B, T, F, generator=gen)
x0 = torch.randn(B, T, F, generator=gen)
for x, layout in ((x0, None), (x0, docs), (wide[..., 4:4 + F], docs)):  # wide[...]: a slice of a wider projection
    for name, got, want in zip(("out", "dx", "dw"), run(kernel, x, w, layout, dy), run(reference, x, w, layout, dy)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)
print("ok")
"""


@_NEEDS_TRITON
def test_the_triton_short_convolution_under_the_interpreter_matches_the_reference() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", _CASES], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                    reason="needs a CUDA GPU with triton")
def test_the_triton_short_convolution_on_cuda_matches_the_fp32_reference() -> None:
    """bf16 at Qwen3.5's 8192 conv channels, packed documents: norm-wise error of the output and both gradients
    against the reference in fp32 within scripts/check_kernels.py's 1e-2 for elementwise ops (a wrong tap or mask is
    O(1); measured on an H200: 1.7e-3 to 2.9e-3, the reference's own in bf16 2.6e-3 to 4.1e-3)."""
    from kernels.attention.attention import Documents, document_cu_seqlens
    from kernels.linear_attention.short_conv import causal_conv1d_silu as reference
    from kernels.linear_attention.triton_short_conv import causal_conv1d_silu as kernel

    gen, dev = torch.Generator("cuda").manual_seed(0), "cuda"
    B, T, F = 2, 4096, 8192
    starts = torch.randint(0, T, (B, 24), generator=gen, device=dev)
    is_start = torch.zeros(B, T, dtype=torch.long, device=dev).scatter_(1, starts, 1)
    ids = is_start.cumsum(1)
    docs = Documents(ids, document_cu_seqlens(ids))
    x, dy = torch.randn(B, T, F, generator=gen, device=dev), torch.randn(B, T, F, generator=gen, device=dev)
    w = torch.randn(F, 4, generator=gen, device=dev) * 0.5

    def run(fn, dtype):
        x_, w_ = (t.detach().to(dtype).requires_grad_() for t in (x, w))
        y = fn(x_, w_, docs)
        y.backward(dy.to(dtype))
        return [t.float() for t in (y, x_.grad, w_.grad)]

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    for name, got, want in zip(("out", "dx", "dw"), run(kernel, torch.bfloat16), run(reference, torch.float32)):
        assert rel(got, want) <= 1e-2, (name, rel(got, want))
