"""scripts/bench.py's own behaviour (its figures are the trainer's metrics): train.py overrides anywhere on the line,
a fresh directory per invocation, and a stop signal passed on to the running cell, which stops before bench.py
exits."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import TINY_MODEL

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench", REPO / "scripts" / "bench.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_overrides_anywhere_on_the_line() -> None:
    args = bench.parse_args(["--layers", "4", "optim.lr=3e-4", "--docs", "chitchat", "x.y=1"])
    assert (args.layers, args.docs, args.extra) == (4, "chitchat", ["optim.lr=3e-4", "x.y=1"])
    cell = bench.cell_overrides(args, "single", "eager", Path("/out/run"), Path("/out/run/tokens.npy"))
    assert cell[-2:] == ["optim.lr=3e-4", "x.y=1"]  # after bench's own: the user's win
    assert "model.arch.num_hidden_layers=4" in cell and "data=chitchat" in cell


def test_each_invocation_writes_a_fresh_directory(tmp_path: Path) -> None:
    first, second = bench.fresh_run_dir(tmp_path), bench.fresh_run_dir(tmp_path)  # the same second, most likely
    assert first != second and first.is_dir() and second.is_dir() and first.parent == second.parent == tmp_path


def _processes_naming(text: str) -> list[str]:
    """Command lines of the live processes whose arguments contain ``text``."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = next(line for line in (proc / "status").read_text().splitlines() if line.startswith("State:"))
        except (OSError, StopIteration):
            continue  # gone meanwhile, or not a process
        if text in cmdline and "zombie" not in state:
            found.append(f"{proc.name}: {cmdline}")
    return found


def test_a_stopped_bench_stops_its_trainer_first(tmp_path: Path) -> None:
    """SIGTERM to bench.py alone (as a scheduler or ``kill`` sends it) during a cell: the trainer gets it, stops after
    its step with a checkpoint, and bench.py exits only then, 143, leaving no process of the run; a second bench with
    the same --out starts its own cells beside the first's."""
    out = tmp_path / "bench"
    command = [sys.executable, str(REPO / "scripts" / "bench.py"), "--model", "qwen3_moe_debug", "--layers", "1",
               "--seq-len", "32", "--local-batch", "2", "--steps", "5000", "--vocab", "255", "--out", str(out),
               *TINY_MODEL, "train.device=cpu", "checkpoint.interval=0"]
    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while not list(out.glob("*/single-eager/metrics.jsonl")):  # the trainer is training
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0][-3000:]
            time.sleep(0.2)
        first.send_signal(signal.SIGTERM)
        log = first.communicate(timeout=240)[0]
    finally:  # nothing of the run left behind by a failing test
        pids = [int(line.split(":")[0]) for line in _processes_naming(str(out))]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        first.kill()
    assert pids == [], f"processes of the run outlived bench.py: {pids}"
    assert first.returncode == 128 + signal.SIGTERM, log[-3000:]
    assert "after saving a checkpoint" in log and "| single | eager | stopped by SIGTERM |" in log, log[-3000:]
    (run,) = out.glob("*/single-eager")
    assert list((run / "checkpoints").glob("step_*")), "the trainer stopped gracefully: a checkpoint"

    second = subprocess.run([*command[:command.index("--steps")], "--steps", "1", "--warmup", "0",
                             *command[command.index("--steps") + 2:]], capture_output=True, text=True, timeout=240)
    assert second.returncode == 0 and "already holds a run" not in second.stdout + second.stderr, second.stderr[-3000:]
    assert len(list(out.glob("*/single-eager/metrics.jsonl"))) == 2


def test_bench_vlm_windows_are_the_loaders_for_data_with_images() -> None:
    """scripts/bench_vlm.py's synthetic windows: as the loader yields data with images (prepare_batches takes them:
    the pad tokens count the images' merged patches), labels never a vision token, and the text row's windows the
    same conversations with text in place of the images."""
    import torch

    from models import build_args
    from tests.conftest import compose_config
    from training.batch import prepare_batches

    spec = importlib.util.spec_from_file_location("bench_vlm", REPO / "scripts" / "bench_vlm.py")
    bench_vlm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_vlm)
    args = bench_vlm.build_parser().parse_intermixed_args(["--seq-len", "96", "--images", "2", "--image-size", "64",
                                                          "--steps", "2", "--local-batch", "2"])
    cfg = compose_config(["model=qwen35_moe_debug", "model.vision=true"])
    margs = build_args(cfg.model.model_type, dict(cfg.model.arch), vision=True)
    vision = margs.vision_config
    with_images = bench_vlm.windows(args, vision, text_only=False)
    text = bench_vlm.windows(args, vision, text_only=True)
    for window, plain in zip(with_images, text):
        ids, labels = window["input_ids"], window["labels"]
        assert ids.shape == plain["input_ids"].shape == (2, 96) and window["position_ids"].shape == (4, 2, 96)
        assert window["image_grid_thw"].tolist() == [[1, 4, 4]] * 4  # 64 pixels: 4 x 4 patches, 4 tokens each
        vision_ids = [vision.image_token_id, vision.vision_start_token_id, vision.vision_end_token_id]
        assert not torch.isin(labels, torch.tensor(vision_ids)).any()
        assert not torch.isin(plain["input_ids"], torch.tensor(vision_ids)).any()
        assert torch.equal(ids[~torch.isin(ids, torch.tensor(vision_ids))],
                           plain["input_ids"][~torch.isin(ids, torch.tensor(vision_ids))])
        batch, = prepare_batches([window], margs, 0, 1, torch.device("cpu"), mtp=False)
        assert batch.images.token_positions_n.numel() == 16


def test_bench_vlm_runs_transformers_with_our_fla_backward_step_where_fla_refuses_its_own(monkeypatch) -> None:
    """On a Hopper GPU with triton 3.4-3.7.0 FLA refuses its gated chunk_bwd_dqkwg: the transformers row registers
    the #640-safe step ours runs (the same kernels in both rows), and nowhere else."""
    from kernels.linear_attention import fla
    from kernels.registry import Env

    spec = importlib.util.spec_from_file_location("bench_vlm", REPO / "scripts" / "bench_vlm.py")
    bench_vlm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_vlm)
    registered = []
    monkeypatch.setattr(fla, "register_hopper_dqkwg", lambda: registered.append(True))
    for env in (Env("cpu"), Env("cuda", "3.7.1", (9, 0), "0.6.0"), Env("cuda", "3.6.0", (8, 0), "0.6.0"),
                Env("cuda", "3.6.0", (9, 0), None)):
        assert bench_vlm.same_fla_backward(env) is None
    assert not registered
    assert "#640-safe chunk_bwd_dqkwg (triton 3.6.0)" in bench_vlm.same_fla_backward(
        Env("cuda", "3.6.0", (9, 0), "0.6.0"))
    assert registered == [True]
