"""Memory bandwidth of the AdamW update kernels on one large parameter (CUDA only): torch's fused AdamW against
``kernels/optim/triton_adamw.py`` with fp32 and bf16 moments, with and without the bf16 compute copy, and the two passes
the Triton update replaces (the clip's ``_foreach_mul_``, the compute copy's cast). Prints ms per update and GB/s.

    python scripts/bench_adamw.py --numel 402653184     # one Qwen3-30B-A3B layer's expert gate_up_proj
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core import device  # noqa: E402
from core.torch_compat import foreach_mul_  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=128 * 1536 * 2048)
    n = parser.parse_args().numel
    if not torch.cuda.is_available():
        raise SystemExit("scripts/bench_adamw.py needs a CUDA GPU (the Triton kernels)")
    from kernels.optim.triton_adamw import adamw_step

    p, g = torch.randn(n, device="cuda"), torch.randn(n, device="cuda") * 1e-2
    hyper = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=10.0, grad_scale=0.5)
    m32, v32 = torch.zeros_like(p), torch.zeros_like(p)
    m16, v16 = torch.zeros_like(p, dtype=torch.bfloat16), torch.zeros_like(p, dtype=torch.bfloat16)
    copy = torch.empty_like(p, dtype=torch.bfloat16)
    fused = torch.optim.AdamW([torch.nn.Parameter(p)], lr=3e-3, fused=True)
    fused.param_groups[0]["params"][0].grad = g
    rows = [("torch fused AdamW, fp32 moments", fused.step, 28),
            ("Triton AdamW, fp32 moments", lambda: adamw_step(p, g, m32, v32, **hyper), 28),
            ("Triton AdamW, fp32 moments + bf16 copy", lambda: adamw_step(p, g, m32, v32, p_copy=copy, **hyper), 30),
            ("Triton AdamW, bf16 moments", lambda: adamw_step(p, g, m16, v16, **hyper), 20),
            ("compute copy cast alone (copy_)", lambda: copy.copy_(p), 6),
            ("clip alone (_foreach_mul_)", lambda: foreach_mul_([g], 1.0), 8)]
    print(f"{n:,} parameters, fp32 p and g")
    for name, step, bytes_per in rows:
        ms = device.time_ms("cuda", step)
        print(f"| {name} | {ms:.2f} ms | {bytes_per * n / ms / 1e6:,.0f} GB/s |")


if __name__ == "__main__":
    main()
