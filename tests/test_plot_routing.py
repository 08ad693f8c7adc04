"""Routing records (logging.routing_every) and scripts/plot_routing.py: per-expert shares against a direct count,
a tiny run's routing.jsonl against moe_metrics' reduction, the PNG, and the error for a run that recorded none."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import train
from models.moe import TopKRouter
from scripts import plot_routing
from tests.dist_utils import run_distributed
from training.config import LoggingConfig
from training.metrics import ROUTING_FILE, MetricLogger, expert_shares, reduce_routing, routing_summary

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_expert_shares_are_each_experts_fraction_of_the_routed_slots():
    torch.manual_seed(0)
    router = TopKRouter(dim=16, num_experts=4, top_k=2, norm_topk_prob=True)
    torch.nn.init.normal_(router.weight)
    _, experts_NK, stats = router(torch.randn(50, 16))
    _, experts2_NK, stats2 = router(torch.randn(30, 16))
    shares = expert_shares(reduce_routing(routing_summary([stats, stats2]), group=None))
    for layer, chosen in enumerate([experts_NK, experts2_NK]):
        counts = torch.bincount(chosen.flatten(), minlength=4).double()
        assert shares[layer] == pytest.approx((counts / counts.sum()).tolist(), rel=1e-6)


def rank_routing(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One router (same weights on every rank) on rank-specific tokens: routing_summary and the chosen experts."""
    torch.manual_seed(0)
    router = TopKRouter(dim=16, num_experts=4, top_k=2, norm_topk_prob=True)
    torch.nn.init.normal_(router.weight)
    torch.manual_seed(1 + rank)
    _, experts_NK, stats = router(torch.randn(20 + 10 * rank, 16))
    return routing_summary([stats]), experts_NK


def shares_worker(rank: int, world_size: int) -> list[list[float]]:
    return expert_shares(reduce_routing(rank_routing(rank)[0], dist.group.WORLD))


def test_shares_are_over_the_data_parallel_group():
    shares = run_distributed(shares_worker, 2)
    counts = torch.bincount(torch.cat([rank_routing(r)[1].flatten() for r in range(2)]), minlength=4).double()
    assert shares == [pytest.approx((counts / counts.sum()).tolist(), rel=1e-6)]


def read_jsonl(path: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines())}


def test_a_run_records_shares_every_routing_step_consistent_with_its_moe_metrics(tiny_run_config):
    # Logged at steps 2 and 4, recorded at every step: shared reductions and routing-only ones.
    cfg = tiny_run_config("train.steps=4", "logging.log_every=2", "logging.routing_every=1", "train.save_final=false")
    train.run(cfg)
    run_dir = Path(cfg.train.output_dir)
    records, metrics = read_jsonl(run_dir / ROUTING_FILE), read_jsonl(run_dir / "metrics.jsonl")
    assert sorted(records) == [1, 2, 3, 4] and sorted(metrics) == [2, 4]
    num_layers = sum(key.endswith("/imbalance") and key.startswith("moe/layer") for key in metrics[2])
    num_experts = len(records[1]["expert_share"][0])
    for record in records.values():
        assert len(record["expert_share"]) == num_layers > 0
        for layer_shares in record["expert_share"]:
            assert len(layer_shares) == num_experts and sum(layer_shares) == pytest.approx(1.0, abs=1e-6)
    for step, m in metrics.items():  # moe_metrics' imbalance: max / mean slots = E x the largest share
        for layer, layer_shares in enumerate(records[step]["expert_share"]):
            assert num_experts * max(layer_shares) == pytest.approx(m[f"moe/layer{layer}/imbalance"], rel=1e-6)


def test_a_resume_keeps_the_records_up_to_the_checkpoint(tmp_path):
    routing_LX = routing_summary([TopKRouter(dim=8, num_experts=4, top_k=2, norm_topk_prob=True)(torch.randn(6, 8))[2]])
    for steps, keep_until in [(range(1, 5), None), (range(3, 4), 2)]:  # killed after step 4; resumed from step 2
        metric_logger = MetricLogger(tmp_path, LoggingConfig(tensorboard=False, routing_every=1), enabled=True,
                                     run_config={}, keep_until=keep_until)
        for step in steps:
            metric_logger.log_routing(step, routing_LX)
        metric_logger.close()
    assert sorted(read_jsonl(tmp_path / ROUTING_FILE)) == [1, 2, 3]


def test_a_run_that_records_no_step_leaves_no_file(tmp_path):
    MetricLogger(tmp_path, LoggingConfig(tensorboard=False, routing_every=10), enabled=True, run_config={}).close()
    assert not (tmp_path / ROUTING_FILE).exists()


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def write_routing(run_dir: Path, steps: list[int], num_layers: int, num_experts: int) -> None:
    run_dir.mkdir(parents=True)
    uniform = [[1 / num_experts] * num_experts] * num_layers
    skewed = [[0.5] + [0.5 / (num_experts - 1)] * (num_experts - 1)] * num_layers
    lines = [{"step": s, "expert_share": uniform if i % 2 else skewed} for i, s in enumerate(steps)]
    (run_dir / ROUTING_FILE).write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_the_plot_is_a_png_of_a_heatmap_per_layer_and_the_imbalance_panel(tmp_path):
    run_dir = tmp_path / "run"
    write_routing(run_dir, [10, 20, 30, 50], num_layers=3, num_experts=8)
    assert plot_routing.main([str(run_dir)]) == 0
    width, height = plot_routing.figure_size(3)
    assert png_size(run_dir / "routing.png") == (round(width * plot_routing.DPI), round(height * plot_routing.DPI))
    fig = plot_routing.make_figure(*plot_routing.read_routing(run_dir))
    heatmaps = [ax for ax in fig.axes if ax.collections]
    curve = next(ax for ax in fig.axes if ax.get_xlabel() == "step")
    assert len(heatmaps) == 3 + 1  # three layers and the colour bar
    # max / mean = E x the largest share: 8 x 0.5 skewed, 8 x 1/8 uniform
    assert [list(line.get_ydata()) for line in curve.get_lines()[:3]] == [pytest.approx([4.0, 1.0, 4.0, 1.0])] * 3


def test_out_names_the_file(tmp_path):
    run_dir = tmp_path / "run"
    write_routing(run_dir, [1], num_layers=1, num_experts=4)
    out = tmp_path / "elsewhere.png"
    assert plot_routing.main([str(run_dir), "--out", str(out)]) == 0
    assert png_size(out) == tuple(round(x * plot_routing.DPI) for x in plot_routing.figure_size(1))


def test_a_run_without_routing_records_fails_in_one_line_naming_the_key(tmp_path, capsys):
    assert plot_routing.main([str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("plot_routing: error: ")
    assert "logging.routing_every" in err and str(tmp_path / ROUTING_FILE) in err
