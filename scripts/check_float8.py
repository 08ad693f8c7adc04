"""Check train.float8=rowwise on a GPU: the experts' FP8 grouped GEMM (kernels/float8/grouped_mm.py) and torchao's
Float8Linear against fp32 and bf16, forward and backward, with timings; or measure the FP8 table.

    python scripts/check_float8.py [--rows 16384] [--experts 128] [--tokens 16384] [--no-compile]
    python scripts/check_float8.py --write-table [--tokens 16384] [--presets ...] [--ep 1,2]

``--write-table``: time every FP8 candidate GEMM of the ``--presets`` models (``parallelisms.float8``'s
candidates: the blocks' linears at ``--tokens`` tokens, eager and compiled; the experts' two grouped GEMMs over
E / ep local experts at tokens x top-k routed rows, eager, as train.compile leaves them) in bf16 and in FP8, forward
+ backward, and write them as this GPU's entry of kernels/float8/table.json (format: kernels/float8/table.py),
keeping the rows of other shapes and sizes. train.float8=rowwise converts only what that entry shows faster.

Experts: Qwen3-30B-A3B (hidden 2048, intermediate 768, 128 experts; and 64 local experts as under ep2) and
Qwen3.5-35B-A3B (intermediate 512, 256 experts), ``--rows`` routed rows with an uneven load and one idle expert;
the gate_up and the down GEMM. Each result (output, dx, dw) against the fp32 per-expert loop: bf16
``torch._grouped_mm`` (the yardstick), the FP8 kernel (torch._scaled_grouped_mm + torchao's Triton quantisers),
and the FP8 kernel against its exact emulation (the CPU-tested reference, run here on the same inputs: the two
differ only by summation order, fast accumulation and bf16 rounding). Linears: the block projections of both
models on ``--tokens`` tokens, nn.Linear bf16 vs Float8Linear (eager, and torch.compile'd unless --no-compile):
the same comparison as the table's, with errors.
Timings: device events around 20 back-to-back runs after 3 warm-ups (forward, forward + backward).
Exits 1 when an FP8 error exceeds its tolerance.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from core import device  # noqa: E402
from kernels.float8.grouped_mm import float8_grouped_mm, padded_layout  # noqa: E402
from kernels.moe.grouped_mm import native_grouped_mm, per_group_mm  # noqa: E402

# e4m3 rounds each operand to ~2^-4 / sqrt(3) relative (RMS): a product of two such operands is ~5% off per term,
# ~3-4% norm-wise over random sums (measured 3.7% in the CPU emulation); 8% fails a wrong scale axis (O(1)).
TOL_FP8 = 8e-2
# The kernel against its emulation: same fp8 operands and scales; fast accumulation and bf16 output rounding only.
TOL_KERNEL_VS_EMULATION = 1e-2


def _time_ms(fn: Callable[[], torch.Tensor], grad: torch.Tensor | None, leaves: list[torch.Tensor]) -> float:
    def step() -> None:
        out = fn()
        if grad is not None:
            torch.autograd.grad(out, leaves, grad)

    return device.time_ms("cuda", step)


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _run(fn: Callable, x: torch.Tensor, w: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    out = fn(x, w)
    dx, dw = torch.autograd.grad(out, [x, w], grad.to(out.dtype))
    return [out.float(), dx.float(), dw.float()]


def _counts(rows: int, experts: int, gen: torch.Generator, dev: torch.device) -> torch.Tensor:
    """An uneven load (a few experts get several times the mean) with expert 1 idle, summing to ``rows``."""
    p = torch.rand(experts, generator=gen, device=dev) ** 3 + 0.05
    p[1] = 0
    counts = torch.multinomial(p, rows, replacement=True, generator=gen).bincount(minlength=experts)
    return counts


def check_experts(name: str, rows: int, experts: int, i: int, o: int, dev: torch.device) -> bool:
    gen = torch.Generator(device=dev).manual_seed(0)
    counts = _counts(rows, experts, gen, dev)
    host = counts.tolist()
    x = torch.randn(rows, i, generator=gen, device=dev).bfloat16()
    w_Gio = (torch.randn(experts, o, i, generator=gen, device=dev) * i**-0.5).bfloat16().transpose(1, 2)
    grad = torch.randn(rows, o, generator=gen, device=dev)
    print(f"{name}: {rows} rows, {experts} experts (largest {max(host)}, idle {host.count(0)}), {i} -> {o}")

    def bf16(x, w):
        return native_grouped_mm(x, w, counts, host)

    def fp8(x, w):
        return float8_grouped_mm(x, w, counts, host)

    def emulated(x, w):
        return float8_grouped_mm(x, w, counts, host, emulate=True)

    ref = _run(lambda x, w: per_group_mm(x.float(), w.float(), counts, host), x, w_Gio, grad)
    got = {"bf16 _grouped_mm": _run(bf16, x, w_Gio, grad), "fp8": _run(fp8, x, w_Gio, grad)}
    emul = _run(emulated, x, w_Gio, grad)
    ok = True
    for what, k in (("out", 0), ("dx", 1), ("dw", 2)):
        errs = {label: _rel(r[k], ref[k]) for label, r in got.items()}
        vs_emul = _rel(got["fp8"][k], emul[k])
        good = errs["fp8"] <= TOL_FP8 and vs_emul <= TOL_KERNEL_VS_EMULATION and torch.isfinite(got["fp8"][k]).all()
        ok &= bool(good)
        print(f"  {what:4s} rel vs fp32: bf16 {errs['bf16 _grouped_mm']:.2e}  fp8 {errs['fp8']:.2e} (tol {TOL_FP8:.0e})"
              f"  fp8 kernel vs emulation {vs_emul:.2e} (tol {TOL_KERNEL_VS_EMULATION:.0e})  "
              f"{'ok' if good else 'FAIL'}")
    idle = [g for g, c in enumerate(host) if c == 0]
    print(f"  dw of the idle experts: max |.| {got['fp8'][2][idle].abs().max().item():.1e} (must be 0)")
    ok &= bool((got["fp8"][2][idle] == 0).all())
    xs, ws = x.detach().requires_grad_(), w_Gio.detach().requires_grad_()
    timings = {}
    for label, fn in (("bf16", bf16), ("fp8", fp8)):
        timings[label] = [_time_ms(lambda fn=fn: fn(xs, ws), None, []),
                          _time_ms(lambda fn=fn: fn(xs, ws), grad.bfloat16(), [xs, ws])]
    print(f"  time fwd: bf16 {timings['bf16'][0]:.3f} ms, fp8 {timings['fp8'][0]:.3f} ms "
          f"({timings['bf16'][0] / timings['fp8'][0]:.2f}x);  fwd+bwd: bf16 {timings['bf16'][1]:.3f} ms, fp8 "
          f"{timings['fp8'][1]:.3f} ms ({timings['bf16'][1] / timings['fp8'][1]:.2f}x)")
    _time_torchao(x, w_Gio, counts, grad)
    return ok


def _time_torchao(x: torch.Tensor, w_Gio: torch.Tensor, counts: torch.Tensor, grad: torch.Tensor) -> None:
    """torchao's own FP8 grouped GEMM (prototype API) on the same padded rows, for comparison of the kernel time."""
    try:
        from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm
    except ImportError as e:
        print(f"  torchao's _to_fp8_rowwise_then_scaled_grouped_mm: not importable ({e})")
        return
    dest, ends, rows = padded_layout(counts, x.shape[0])
    x_P = x.new_zeros(rows, x.shape[1]).index_copy(0, dest, x).requires_grad_()
    w = w_Gio.detach().requires_grad_()
    g = grad.new_zeros(rows, grad.shape[1]).index_copy(0, dest, grad).bfloat16()
    try:
        fn = lambda: _to_fp8_rowwise_then_scaled_grouped_mm(x_P, w, ends, pad_token_groups_for_grouped_mm=False)
        print(f"  torchao's FP8 grouped GEMM on the padded rows: fwd {_time_ms(fn, None, []):.3f} ms, fwd+bwd "
              f"{_time_ms(fn, g, [x_P, w]):.3f} ms")
    except Exception as e:  # a prototype API: report, do not fail the check
        print(f"  torchao's FP8 grouped GEMM failed: {type(e).__name__}: {str(e)[:200]}")


def _float8_linear(linear: torch.nn.Linear) -> torch.nn.Module:
    """torchao's rowwise Float8Linear sharing ``linear``'s weight (in a Sequential: torchao converts children)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    d_out, d_in = linear.weight.shape
    fp8 = convert_to_float8_training(
        torch.nn.Sequential(torch.nn.Linear(d_in, d_out, bias=False)).to(linear.weight.device),
        config=Float8LinearConfig.from_recipe_name("rowwise"))
    fp8[0].weight = linear.weight
    return fp8


def check_linears(tokens: int, dev: torch.device, compile_too: bool) -> None:
    shapes = {  # (in, out) of the block projections
        "qwen3 q_proj": (2048, 4096), "qwen3 k/v_proj": (2048, 512), "qwen3 o_proj": (4096, 2048),
        "qwen3.5 attn q_proj (gated)": (2048, 8192), "qwen3.5 attn o_proj": (4096, 2048),
        "qwen3.5 in_proj_qkv": (2048, 8192), "qwen3.5 in_proj_z": (2048, 4096), "qwen3.5 out_proj": (4096, 2048),
        "qwen3.5 shared gate/up": (2048, 512), "qwen3.5 shared down": (512, 2048),
    }
    gen = torch.Generator(device=dev).manual_seed(0)
    print(f"linears: {tokens} tokens, bf16 nn.Linear vs rowwise Float8Linear")
    for name, (d_in, d_out) in shapes.items():
        linear = torch.nn.Linear(d_in, d_out, bias=False, device=dev, dtype=torch.bfloat16)
        x = torch.randn(tokens, d_in, generator=gen, device=dev).bfloat16()
        grad = torch.randn(tokens, d_out, generator=gen, device=dev).bfloat16()
        fp8 = _float8_linear(linear)
        ref = _run(lambda x, w: x.float() @ w.float().T, x, linear.weight, grad.float())
        got = _run(lambda x, w: torch.nn.functional.linear(x, w), x, linear.weight, grad)
        xs = x.detach().requires_grad_()
        out = fp8(xs)
        fp8_got = [out.float(), *(g.float() for g in torch.autograd.grad(out, [xs, fp8[0].weight], grad))]
        errs = "  ".join(f"{what} bf16 {_rel(b, r):.2e} fp8 {_rel(f, r):.2e}"
                         for what, b, f, r in zip(("out", "dx", "dw"), got, fp8_got, ref))
        t = {"bf16": _time_ms(lambda: linear(xs), grad, [xs, linear.weight]),
             "fp8": _time_ms(lambda: fp8(xs), grad, [xs, linear.weight])}
        if compile_too:
            compiled = torch.compile(fp8)
            t["fp8 compiled"] = _time_ms(lambda: compiled(xs), grad, [xs, linear.weight])
        times = ", ".join(f"{k} {v:.3f} ms ({t['bf16'] / v:.2f}x)" for k, v in t.items())
        print(f"  {name:28s} {d_in:5d} -> {d_out:5d}  rel vs fp32: {errs}\n  {'':28s} fwd+bwd {times}")


def check_gather(tokens: int, experts: int, top_k: int, d_in: int, d_out: int, dev: torch.device) -> bool:
    """The dispatch gather fused with the FP8 quantisation (kernels/float8/permute.py): the Triton kernel's e4m3
    rows and scales against its torch reference (exactly), the fused gather + quantise against gather, padded copy
    and quantise, and the experts' first GEMM end to end (fwd+bwd): bf16 gather + grouped GEMM, gather + FP8
    GEMM, the fused FP8 GEMM (forward and gradients equal to the unfused one)."""
    from kernels.float8.grouped_mm import torchao_quantizers
    from kernels.float8.permute import float8_grouped_mm_gathered, gather_quantize_rows_torch
    from kernels.float8.triton_permute import gather_quantize_rows
    from kernels.moe.permute import inverse_permutation, permute_tokens

    gen = torch.Generator(device=dev).manual_seed(0)
    src = torch.randn(tokens, d_in, generator=gen, device=dev).bfloat16()
    experts_NK = torch.stack([torch.randperm(experts, generator=gen, device=dev)[:top_k] for _ in range(tokens)])
    order = torch.argsort(experts_NK.flatten(), stable=True)
    inv, token = inverse_permutation(order), order // top_k
    counts = experts_NK.flatten().bincount(minlength=experts)
    dest, _, rows = padded_layout(counts, token.numel())
    index_P = token.new_full((rows,), -1).index_copy(0, dest, token)
    data, scale = gather_quantize_rows(src, index_P)
    want_data, want_scale = gather_quantize_rows_torch(src, index_P)
    ok = bool(torch.equal(data.view(torch.uint8), want_data.view(torch.uint8)) and torch.equal(scale, want_scale))
    print(f"gather + quantise, {tokens} tokens x top-{top_k} over {experts} experts, {d_in} -> {d_out}: Triton vs "
          f"reference {'exact' if ok else 'DIFFERENT'}")
    rows_q = torchao_quantizers().rows
    fused = device.time_ms("cuda", lambda: gather_quantize_rows(src, index_P))
    apart = device.time_ms("cuda", lambda: rows_q(src.new_zeros(rows, d_in).index_copy(0, dest, src[token])))
    print(f"  forward: fused {fused:.3f} ms, gather + padded copy + torchao quantise {apart:.3f} ms "
          f"({apart / fused:.2f}x)")
    w_Gio = (torch.randn(experts, d_out, d_in, generator=gen, device=dev) * d_in**-0.5).bfloat16().transpose(1, 2)
    grad = torch.randn(token.numel(), d_out, generator=gen, device=dev).bfloat16()
    x, w = src.detach().requires_grad_(), w_Gio.detach().requires_grad_()
    host = counts.tolist()
    variants = {"bf16 gather + grouped GEMM": lambda: native_grouped_mm(permute_tokens(x, token, inv), w, counts, host),
                "gather + FP8 GEMM": lambda: float8_grouped_mm(permute_tokens(x, token, inv), w, counts),
                "fused FP8 GEMM": lambda: float8_grouped_mm_gathered(x, token, inv, w, counts)}
    outs = [[out, *torch.autograd.grad(out, [x, w], grad)] for out in (variants[k]() for k in list(variants)[1:])]
    same = all(torch.equal(a, b) for a, b in zip(*outs))
    ok &= same
    times = {k: _time_ms(fn, grad, [x, w]) for k, fn in variants.items()}
    base = times["bf16 gather + grouped GEMM"]
    print("  fwd+bwd: " + ", ".join(f"{k} {v:.3f} ms ({base / v:.2f}x of bf16)" for k, v in times.items())
          + f"; fused == unfused: {'yes' if same else 'NO'}")
    return ok


# ---------------------------------------------------------------------------------------- the FP8 table

def table_shapes(presets: list[str], eps: list[int]) -> tuple[set[tuple[int, int]], set[tuple[int, ...]]]:
    """The aligned FP8 candidates of the presets' models (built on meta, 4 layers: every kind of block), as the
    table keys them: linears (in, out); grouped GEMMs (in, out, local experts, top-k, gathered) for each ep."""
    from omegaconf import OmegaConf

    import models
    from parallelisms.float8 import float8_candidates

    linears, experts = set(), set()
    for preset in presets:
        conf = OmegaConf.load(REPO / "conf" / "model" / f"{preset}.yaml")
        arch = {**OmegaConf.to_container(conf.arch), "num_hidden_layers": 4}
        spec = models.get_spec(conf.model_type)
        with torch.device("meta"):
            model = spec.model_cls(models.build_args(conf.model_type, arch))
        for ep in eps:
            for c in float8_candidates(model, spec, ep):
                if c.aligned and c.kind == "linear":
                    linears.add((c.d_in, c.d_out))
                elif c.aligned:  # the first GEMM takes its rows from the dispatch gather
                    experts.add((c.d_in, c.d_out, c.groups, arch["num_experts_per_tok"], c.name == "experts gate_up"))
    return linears, experts


def _compiled_ms(module: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor, leaves: list[torch.Tensor]
                 ) -> float | None:
    try:
        compiled = torch.compile(module)
        return _time_ms(lambda: compiled(x), grad, leaves)
    except Exception as e:  # recorded as not measured (null): the rule then keeps this shape in bf16
        print(f"    torch.compile failed: {type(e).__name__}: {str(e)[:200]}")
        return None


def measure_linear(d_in: int, d_out: int, tokens: int, dev: torch.device) -> dict:
    gen = torch.Generator(device=dev).manual_seed(0)
    linear = torch.nn.Linear(d_in, d_out, bias=False, device=dev, dtype=torch.bfloat16)
    fp8 = _float8_linear(linear)
    x = torch.randn(tokens, d_in, generator=gen, device=dev).bfloat16().requires_grad_()
    grad = torch.randn(tokens, d_out, generator=gen, device=dev).bfloat16()
    leaves = [x, linear.weight]
    row = {"in": d_in, "out": d_out, "tokens": tokens,
           "bf16_ms": _time_ms(lambda: linear(x), grad, leaves), "fp8_ms": _time_ms(lambda: fp8(x), grad, leaves),
           "bf16_compiled_ms": _compiled_ms(linear, x, grad, leaves),
           "fp8_compiled_ms": _compiled_ms(fp8, x, grad, leaves)}
    torch.compiler.reset()
    return row


def measure_grouped(d_in: int, d_out: int, groups: int, top_k: int, rows: int, gathered: bool,
                    dev: torch.device) -> dict:
    """One experts GEMM as compute_experts calls it (uneven load, one idle expert), eager (train.compile leaves
    the experts eager, so the table has no compiled times for them). ``gathered`` (the first GEMM): from the
    dispatch gather of rows / top-k tokens, bf16 gather + grouped GEMM against the FP8 GEMM fused with it."""
    from kernels.float8.permute import float8_grouped_mm_gathered
    from kernels.moe.permute import inverse_permutation, permute_tokens

    gen = torch.Generator(device=dev).manual_seed(0)
    counts = _counts(rows, groups, gen, dev)
    host = counts.tolist()
    x = torch.randn(rows // top_k if gathered else rows, d_in, generator=gen, device=dev).bfloat16().requires_grad_()
    order = torch.randperm(rows, generator=gen, device=dev)  # routed row m reads token order[m] // top_k
    token, inv = order // top_k, inverse_permutation(order)
    w = (torch.randn(groups, d_out, d_in, generator=gen, device=dev) * d_in**-0.5).bfloat16()
    w_Gio = w.transpose(1, 2).requires_grad_()
    grad = torch.randn(rows, d_out, generator=gen, device=dev).bfloat16()
    leaves = [x, w_Gio]
    if gathered:
        bf16 = lambda: native_grouped_mm(permute_tokens(x, token, inv), w_Gio, counts, host)  # noqa: E731
        fp8 = lambda: float8_grouped_mm_gathered(x, token, inv, w_Gio, counts)  # noqa: E731
    else:
        bf16 = lambda: native_grouped_mm(x, w_Gio, counts, host)  # noqa: E731
        fp8 = lambda: float8_grouped_mm(x, w_Gio, counts, host)  # noqa: E731
    return {"in": d_in, "out": d_out, "groups": groups, "rows": rows, "gathered": gathered,
            "bf16_ms": _time_ms(bf16, grad, leaves), "fp8_ms": _time_ms(fp8, grad, leaves)}


def write_table(presets: list[str], eps: list[int], tokens: int, dev: torch.device) -> None:
    import datetime

    from kernels.float8.table import TABLE_PATH, write_gpu_rows

    linears, experts = table_shapes(presets, eps)
    gpu = device.module("cuda").get_device_name()
    print(f"FP8 table for {gpu!r}: {len(linears)} linear shapes at {tokens} tokens, {len(experts)} grouped GEMMs")
    linear_rows, expert_rows = [], []
    for d_in, d_out in sorted(linears):
        linear_rows.append(measure_linear(d_in, d_out, tokens, dev))
        print("  linear " + _row_text(linear_rows[-1]))
    for d_in, d_out, groups, top_k, gathered in sorted(experts):
        expert_rows.append(measure_grouped(d_in, d_out, groups, top_k, tokens * top_k, gathered, dev))
        print("  experts " + _row_text(expert_rows[-1]))
    import torchao

    measured = {"torch": torch.__version__, "torchao": torchao.__version__, "date": str(datetime.date.today()),
                "command": " ".join(["python scripts/check_float8.py", *sys.argv[1:]])}
    write_gpu_rows(gpu, measured, linear_rows, expert_rows)
    print(f"wrote {gpu!r} to {TABLE_PATH}")


def _row_text(row: dict) -> str:
    shape = ", ".join(f"{k} {row[k]}" for k in ("in", "out", "groups", "tokens", "rows", "gathered") if k in row)
    times = "  ".join(f"{k} {v:.3f}" if v is not None else f"{k} -" for k, v in row.items() if k.endswith("_ms"))
    gains = [f"{mode} {row['bf16' + sfx] / row['fp8' + sfx]:.2f}x" for mode, sfx in (("eager", "_ms"),
             ("compiled", "_compiled_ms")) if row.get("bf16" + sfx) and row.get("fp8" + sfx)]
    return f"{shape}: {times}  (FP8 {', '.join(gains)})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=16384, help="routed rows per grouped GEMM")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per linear")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile'd Float8Linear timing")
    parser.add_argument("--write-table", action="store_true",
                        help="measure this GPU's FP8 table (kernels/float8/table.json) instead of the checks")
    parser.add_argument("--presets", default="qwen3_moe_30b_a3b,qwen3_moe_235b_a22b,qwen35_moe",
                        help="conf/model presets whose GEMM shapes the table gets")
    parser.add_argument("--ep", default="1,2", help="expert-parallel degrees whose local expert counts it gets")
    args = parser.parse_args(argv)
    if device.device_type("auto") != "cuda":
        print("no CUDA device: nothing to check here (tests/test_float8.py checks the emulation on CPU)")
        return 0
    dev = device.local_device("cuda")
    capability = device.module("cuda").get_device_capability()
    print(f"{device.module('cuda').get_device_name()} (sm_{capability[0]}{capability[1]}), torch {torch.__version__}")
    if args.write_table:
        write_table(args.presets.split(","), [int(e) for e in args.ep.split(",")], args.tokens, dev)
        return 0
    ok = True
    for name, rows, experts, i, o in [
            ("qwen3-30b-a3b gate_up", args.rows, args.experts, 2048, 2 * 768),
            ("qwen3-30b-a3b down", args.rows, args.experts, 768, 2048),
            ("qwen3-30b-a3b gate_up, ep2 (64 local), 4x rows", 4 * args.rows, 64, 2048, 2 * 768),
            ("qwen3-30b-a3b down, ep2 (64 local), 4x rows", 4 * args.rows, 64, 768, 2048),
            ("qwen3.5-35b-a3b gate_up, ep2 (128 local)", 4 * args.rows, 128, 2048, 2 * 512),
            ("qwen3.5-35b-a3b down, ep2 (128 local)", 4 * args.rows, 128, 512, 2048)]:
        ok &= check_experts(name, rows, experts, i, o, dev)
    for d_in, d_out, experts in ((2048, 2 * 768, 128), (4096, 2 * 1536, 128)):  # Qwen3-30B-A3B, 235B gate_up
        ok &= check_gather(args.tokens, experts, 8, d_in, d_out, dev)
    check_linears(args.tokens, dev, not args.no_compile)
    print("all FP8 errors within tolerance" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
