"""Throughput benchmark: tokens/s/GPU, TFLOPS/GPU, MFU and peak memory for a layout x dispatcher grid.

    python scripts/bench.py --model qwen3_moe_30b_a3b --layers 8 --nproc 2 --layouts ep2,fsdp2 \\
        --dispatchers eager --seq-len 4096 --local-batch 4 --steps 20

Each grid cell is one ``train.py`` run (under torchrun when --nproc > 1) on random token ids, bf16 compute
with fp32 master weights, optimizer state and gradient reduction. Steps before --warmup are not averaged.
FLOPs per token are counted as torchtitan does (``flops_per_token`` of the model's args): 6 x active
non-embedding parameters (LM head included) + 12 x layers x heads x head_dim x seq_len for attention
(Qwen3.5: full-attention layers only, plus the documented DeltaNet term). MFU = achieved / peak dense bf16
(core/device.py's table; 989 TFLOP/s for an H100/H200). "data loading" is the share of the step spent in the
data loader and the host-to-device copy (train.py's data_share metric).

Packed documents (``--docs``): ``none`` (default) is one causal sequence per window; ``fixed:N`` documents of N
tokens; ``lognormal:MEDIAN,SIGMA`` lengths drawn (``--seed``) from a log-normal of that median and sigma, at least
1 token; each ended by ``--vocab`` (Qwen's <|endoftext|>, never drawn as a random id) and read with
``data.eos_id`` so position ids restart per document; ``chitchat`` the Chit-Chat corpus through the data
pipeline (real conversations, ChatML). Windows are cut from the stream, so a document may straddle two windows.
"attended MFU" counts only the attention pairs computed (each document's causal half:
``training.metrics.attended_flops_per_token``) and the LM head over trained labels only, so packed and causal rows
compare fairly; tokens/s stays the headline. Free disk space of the output and Triton cache directories is printed at
start and end (a full disk fails a checkpoint write with ``unexpected pos``).

Routing (``--routing``): ``learned`` (default) is the model's router, which on random weights may collapse onto a
few experts as it trains, differently on random ids and on text, so two data sources' rows then differ by their
grouped GEMMs' shapes; ``balanced`` routes every token round robin (``model.arch.router_force_balance``: equal
expert loads whatever the data), so rows of different data compare the data path alone.

    python scripts/bench.py --layers 4 --seq-len 32768 --local-batch 1 --docs fixed:2048

train.py overrides may stand anywhere on the line (``--layers 4 optim.lr=3e-4 --docs chitchat``). Each invocation
writes its cells and ``bench.json`` into a fresh directory under --out (``--out/<date>-<time>``, printed at start),
so a second bench with the same --out never meets the first one's runs; the tokenized-corpus cache
(``--out/cache``) is shared. SIGTERM or Ctrl-C is passed on to the running cell's whole process group (train.py, or
torchrun and its ranks): bench.py waits for them to stop (the trainer stops after its current step, with a
checkpoint where it has a directory for one), prints the rows done so far and exits 128 + the signal's number.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def document_lengths(spec: str, total: int, seed: int) -> np.ndarray:
    """Document lengths for ``--docs`` fixed:N or lognormal:MEDIAN,SIGMA, covering ``total`` tokens."""
    kind, _, params = spec.partition(":")
    if kind == "fixed":
        n = int(params)
        return np.full(-(-total // n), n)
    if kind == "lognormal":
        median, sigma = (float(x) for x in params.split(","))
        lengths = np.maximum(1, np.random.default_rng(seed).lognormal(np.log(median), sigma, size=total)).astype(int)
        return lengths[:np.searchsorted(lengths.cumsum(), total) + 1]
    raise SystemExit(f"--docs {spec!r}: expected none, fixed:N, lognormal:MEDIAN,SIGMA or chitchat")


def write_tokens(args: argparse.Namespace, path: Path) -> None:
    """Random token ids for every step, documents ended by --vocab unless --docs none."""
    need = args.steps * args.local_batch * args.nproc * (args.seq_len + 1) * 2
    ids = np.random.default_rng(args.seed).integers(0, args.vocab, size=need, dtype=np.int64)
    if args.docs != "none":
        ends = document_lengths(args.docs, need, args.seed).cumsum() - 1  # a document's last token is its EOS
        ids[ends[ends < need]] = args.vocab
    np.save(path, ids)


def data_overrides(args: argparse.Namespace, tokens: Path) -> list[str]:
    if args.docs == "chitchat":
        return ["data=chitchat"]
    return ["data=tokens", f"data.path={tokens}", *([f"data.eos_id={args.vocab}"] if args.docs != "none" else [])]


def disk_line(when: str, out: Path) -> str:
    """Free space where the run writes (checkpoints, the data cache) and where Triton (and FLA's autotuner) cache."""
    triton = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    parts = []
    for name, path in (("output", out), ("triton cache", triton)):
        existing = next(p for p in (path, *path.parents) if p.exists())
        parts.append(f"{name} {path}: {shutil.disk_usage(existing).free / 2**30:.1f} GiB free")
    return f"disk at {when}: " + "; ".join(parts)


def cell_overrides(args: argparse.Namespace, layout: str, dispatcher: str, out: Path, tokens: Path) -> list[str]:
    """The train.py overrides of one grid cell, written under ``out`` (this invocation's directory; the data cache is
    --out's, shared by invocations). tests/test_docs.py composes the documented bench commands' cells."""
    return [f"model={args.model}", f"model.arch.num_hidden_layers={args.layers}", f"parallel={layout}",
            f"dispatcher={dispatcher}", *data_overrides(args, tokens), f"data.seq_len={args.seq_len}",
            f"data.cache_dir={args.out / 'cache'}", f"train.local_batch_size={args.local_batch}",
            f"train.steps={args.steps}", f"train.output_dir={out / f'{layout}-{dispatcher}'}",
            "train.save_final=false", "logging.tensorboard=false", f"logging.profile_step={args.profile_step}",
            f"logging.profile_steps={args.profile_steps}",
            *(["model.arch.router_force_balance=true"] if args.routing == "balanced" else []), *args.extra]


class Child:
    """The running cell's process, in a process group of its own, so that bench.py can pass a signal on to all of
    it (torchrun and its ranks too) and wait for all of it: without this a SIGTERM to bench.py alone (a scheduler's
    stop, ``kill``, ``timeout``) ended bench.py and left the trainer training, holding its GPU memory."""

    STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
    GROUP_GRACE_S = 60.0  # what is left of the group once the child has exited: a rank still saving, then SIGKILL

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.signum: int | None = None  # the first stop signal bench.py received

    def handle(self, signum: int, frame) -> None:
        """Record the signal and pass it on to the running cell's group (a second Ctrl-C too: the trainer then
        stops at once)."""
        self.signum = self.signum or signum
        if self.process is not None:
            self._signal_group(signum)

    def _signal_group(self, signum: int) -> bool:
        """Send ``signum`` to the cell's process group; False once the group has no process left."""
        try:
            os.killpg(self.process.pid, signum)
            return True
        except ProcessLookupError:
            return False

    def run(self, command: list[str]) -> int:
        """Run ``command`` to its end in a new process group (not started after a stop signal) and wait until no
        process of that group is left: torchrun's ranks may outlive it."""
        if self.signum is not None:
            return 128 + self.signum
        self.process = subprocess.Popen(command, cwd=REPO, start_new_session=True)
        if self.signum is not None:  # arrived between the check above and the start
            self._signal_group(self.signum)
        try:
            returncode = self.process.wait()
            deadline = time.monotonic() + self.GROUP_GRACE_S
            while self._signal_group(0):
                if time.monotonic() > deadline:
                    print(f"bench: the cell's processes outlived it by {self.GROUP_GRACE_S:.0f} s: killed",
                          file=sys.stderr)
                    self._signal_group(signal.SIGKILL)
                    break
                time.sleep(0.1)
            return returncode
        finally:
            self.process = None


CHILD = Child()


def fresh_run_dir(out: Path) -> Path:
    """A new directory under ``out`` for this invocation's cells: ``<date>-<time>``, with a suffix if another
    invocation took that name in the same second."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        path = out / (stamp if n == 0 else f"{stamp}-{n}")
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            continue
    raise SystemExit(f"bench: no free directory name under {out} for {stamp}")


def run_cell(args: argparse.Namespace, layout: str, dispatcher: str, out: Path, tokens: Path) -> dict:
    cell_dir = out / f"{layout}-{dispatcher}"
    overrides = cell_overrides(args, layout, dispatcher, out, tokens)
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"]
                if args.nproc > 1 else [sys.executable])
    returncode = CHILD.run([*launcher, str(REPO / "train.py"), *overrides])
    summary = cell_dir / "profile" / "summary_rank0.md"
    if summary.exists():
        print(summary.read_text())
    if CHILD.signum is not None:
        return {"layout": layout, "dispatcher": dispatcher, "error": f"stopped by {signal.Signals(CHILD.signum).name}"}
    if returncode != 0:
        return {"layout": layout, "dispatcher": dispatcher, "error": f"exit code {returncode}"}
    metrics = [json.loads(line) for line in (cell_dir / "metrics.jsonl").open()]
    # The profiled steps run slower (the profiler's own overhead): they are not averaged.
    profiled = range(args.profile_step, args.profile_step + args.profile_steps) if args.profile_step else range(0)
    timed = [m for m in metrics[args.warmup:] if m["step"] not in profiled] or metrics
    mean = lambda key: float(np.mean([m[key] for m in timed]))  # noqa: E731
    tps = mean("tokens_per_s_per_device")
    mfu = mean("mfu") if timed[0]["mfu"] is not None else None
    attended_mfu = mean("attended_mfu") if timed[0]["attended_mfu"] is not None else None
    return {"layout": layout, "dispatcher": dispatcher, "tokens_per_s_per_gpu": tps,
            "tflops_per_gpu": mean("tflops_per_device"), "mfu": mfu,
            "attended_tflops_per_gpu": mean("attended_tflops_per_device"), "attended_mfu": attended_mfu,
            "peak_mem_gib": max(m["peak_mem_gib"] for m in metrics), "final_loss": metrics[-1]["loss"],
            "data_share": mean("data_share")}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3_moe_30b_a3b")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--layouts", default="single")
    parser.add_argument("--dispatchers", default="eager")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--local-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "bench")
    parser.add_argument("--vocab", type=int, default=151643, help="token ids are drawn below this")
    parser.add_argument("--profile-steps", type=int, default=1,
                        help="profile this many steps from --profile-step (the window runs unsynchronised, as every "
                             "step does: the per-step figures are the steady state's)")
    parser.add_argument("--profile-step", type=int, default=0,
                        help="profile this step (not averaged) and print each cell's summary")
    parser.add_argument("--docs", default="none",
                        help="none | fixed:N | lognormal:MEDIAN,SIGMA | chitchat (packed documents, see above)")
    parser.add_argument("--seed", type=int, default=0, help="token ids and --docs lognormal lengths")
    parser.add_argument("--routing", choices=("learned", "balanced"), default="learned",
                        help="the model's router, or round robin for every token (see above)")
    parser.add_argument("extra", nargs="*", help="more train.py overrides, anywhere on the line")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """bench.py's arguments, train.py's overrides among them as train.py takes them: anywhere on the line."""
    return build_parser().parse_intermixed_args(argv)


def main() -> None:
    args = parse_args()
    for signum in Child.STOP_SIGNALS:
        signal.signal(signum, CHILD.handle)
    out = fresh_run_dir(args.out)
    print(f"bench: this run's cells go under {out}")
    print(disk_line("start", out))
    tokens = out / "random_tokens.npy"
    if args.docs != "chitchat":
        write_tokens(args, tokens)
    rows = []
    for layout in args.layouts.split(","):
        for dispatcher in args.dispatchers.split(","):
            if CHILD.signum is None:
                rows.append(run_cell(args, layout, dispatcher, out, tokens))
    print(f"\n{args.model} x {args.layers} layers, seq {args.seq_len}, local batch {args.local_batch}, "
          f"{args.nproc} process(es), documents {args.docs}, routing {args.routing}, "
          f"mean over steps {args.warmup + 1}..{args.steps}")
    print("| layout | dispatcher | tokens/s/GPU | TFLOPS/GPU | MFU | attended MFU | peak mem GiB | data loading | "
          "final loss |")
    print("|---|---|---|---|---|---|---|---|---|")
    percent = lambda x: "-" if x is None else f"{x:.1%}"  # noqa: E731
    for r in rows:
        if "error" in r:
            print(f"| {r['layout']} | {r['dispatcher']} | {r['error']} | | | | | | |")
            continue
        tflops = f"{r['tflops_per_gpu']:.0f}"
        print(f"| {r['layout']} | {r['dispatcher']} | {r['tokens_per_s_per_gpu']:,.0f} | {tflops} | "
              f"{percent(r['mfu'])} | {percent(r['attended_mfu'])} | {r['peak_mem_gib']:.1f} | "
              f"{r['data_share']:.2%} | {r['final_loss']:.3f} |")
    print(disk_line("end", out))
    (out / "bench.json").write_text(json.dumps(rows, indent=2))
    if CHILD.signum is not None:
        sys.exit(128 + CHILD.signum)


if __name__ == "__main__":
    main()
