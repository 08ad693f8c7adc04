"""One run = one directory: logs of every rank, config, metrics and weights in train.output_dir and nothing
anywhere else; config.yaml re-runs the run; the start-up summary and the cumulative token count."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train
from training import startup
from models import build_args, get_spec
from tests.conftest import TINY_MODEL, write_tokens

REPO = Path(__file__).resolve().parents[1]


def _train_cli(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """``python <repo>/train.py <args>`` started in ``cwd``: anything written outside the run directory lands there."""
    out = subprocess.run([sys.executable, str(REPO / "train.py"), *args], cwd=cwd, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_torchrun_job_writes_only_its_run_directory_and_its_config_reruns(tmp_path):
    data = write_tokens(tmp_path / "tokens.npy", 4000)
    common = [*TINY_MODEL, "data=tokens", f"data.path={data}", "data.seq_len=32", "train.steps=2",
              f"data.cache_dir={tmp_path / 'cache'}"]
    _train_cli(tmp_path, *common, "parallel=ep2", "launch.nproc_per_node=2", "logging.all_ranks=true",
               "train.output_dir=run")
    run = tmp_path / "run"
    # Nothing beside the run directory (no Hydra outputs/<date>/<time>, no .hydra copy).
    assert {p.name for p in tmp_path.iterdir()} - {"cache"} == {"run", "tokens.npy"}
    assert {p.name for p in run.iterdir()} == {"config.yaml", "metrics.jsonl", "model.safetensors", "tensorboard",
                                               "model.safetensors.record.json", "train.log", "logs", "checkpoints",
                                               "run.json", "run.lock"}
    log = (run / "train.log").read_text()
    assert "layout: world 2 = dp 2 x cp 1; experts: ep 2 x efsdp 1 x edp 1; fsdp2; dispatcher fused" in log
    assert "global batch: 8 sequences x 32 tokens = 256 tokens per step" in log
    assert "step     2/2" in log and "done: 2 of 2 steps" in log
    assert (run / "logs" / "rank_1.log").exists()  # logging.all_ranks: every other rank's log beside train.log

    # The run's config.yaml is a complete primary config: the same run again, here on one process.
    _train_cli(tmp_path, "--config-path", str(run), "--config-name", "config", "train.output_dir=rerun",
               "parallel.ep_size=1", "parallel.backend.name=none", "launch.nproc_per_node=1",
               "train.local_batch_size=8")  # the same global batch on one process
    assert _losses(tmp_path / "rerun") == pytest.approx(_losses(run), rel=1e-5)
    assert "train.log" in {p.name for p in (tmp_path / "rerun").iterdir()}
    assert not (tmp_path / "rerun" / "logs").exists()  # other ranks' logs only on request


def test_reusing_a_run_directory_without_resume_is_refused(tmp_path):
    data = write_tokens(tmp_path / "tokens.npy", 4000)
    args = [*TINY_MODEL, "data=tokens", f"data.path={data}", "data.seq_len=32", "train.steps=1",
            f"data.cache_dir={tmp_path / 'cache'}", "train.output_dir=run"]
    _train_cli(tmp_path, *args)
    before = (tmp_path / "run" / "metrics.jsonl").read_bytes()
    out = subprocess.run([sys.executable, str(REPO / "train.py"), *args], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 1 and "already holds a run" in out.stderr
    assert (tmp_path / "run" / "metrics.jsonl").read_bytes() == before


def test_summary_and_cumulative_tokens_survive_a_resume(tiny_run_config, caplog):
    caplog.set_level(logging.INFO, logger="train")
    whole = train.run(tiny_run_config("train.steps=3"))
    assert [m["tokens_total"] for m in whole] == [128, 256, 384]  # 4 sequences x 32 tokens per step
    assert "global batch: 4 sequences x 32 tokens = 128 tokens per step (local 4 x grad accum 1 x dp 1)" in caplog.text
    assert "done: 3 of 3 steps" in caplog.text
    run_dir = Path(tiny_run_config().train.output_dir)
    first = train.run(tiny_run_config("train.steps=2", "checkpoint.interval=1", f"train.output_dir={run_dir}-2"))
    resumed = train.run(tiny_run_config("train.steps=3", "train.resume=auto", "train.allow_changes=[train.steps]",
                                        f"train.output_dir={run_dir}-2"))
    assert [m["tokens_total"] for m in first + resumed] == [128, 256, 384]


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen3_5_moe"])
def test_parameter_counts(model_type):
    """Total against transformers' count of the same architecture; active: the routed experts a token skips
    removed, counted from the shapes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from models.hf_io import _hf_names

    spec = get_spec(model_type)
    arch = dict(vocab_size=256, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
    args = build_args(model_type, arch)
    with torch.device("meta"):
        total, active = spec.parameter_counts(spec.model_cls(args))
    hf_spec = get_spec(spec.hf_export_type) if spec.hf_export_type else spec
    config = AutoConfig.for_model(hf_spec.model_type, **_hf_names(hf_spec).config_from_arch(args))
    with torch.device("meta"):
        assert total == AutoModelForCausalLM.from_config(config).num_parameters()
    skipped = args.num_hidden_layers * (args.num_experts - args.num_experts_per_tok) * 3 * 32 * 16
    assert active == total - skipped


def test_checkpoints_from_before_model_tokenizer_still_resume(tiny_run_config):
    """data.tokenizer moved to model.tokenizer: an older checkpoint's value is compared under the new key; keys
    added since (data.bin_dtype, data.sources) count as their defaults."""
    from omegaconf import OmegaConf

    cfg = tiny_run_config("data=chitchat", "model.arch.vocab_size=151936")
    current = OmegaConf.to_container(OmegaConf.structured(cfg))
    old_data = {k: v for k, v in current["data"].items() if k not in ("bin_dtype", "sources")}
    old = {**current, "model": {k: v for k, v in current["model"].items() if k != "tokenizer"},
           "data": {**old_data, "tokenizer": "qwen3"}}
    startup.check_resumed_config({"config": old}, current, 4, [], Path("step_1"), log=False)
    old["data"]["tokenizer"] = "qwen3_5"
    with pytest.raises(ValueError, match="model.tokenizer: 'qwen3_5' -> 'qwen3'"):
        startup.check_resumed_config({"config": old}, current, 4, [], Path("step_1"), log=False)


def test_log_handlers_that_hydra_did_not_make_are_left_alone(tiny_run_config, tmp_path):
    """A user's (or pytest's) file handler keeps its file, however empty, and /dev/null stays a device."""
    import stat

    empty = tmp_path / "user.log"
    handler = logging.FileHandler(empty, delay=False)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        train.run(tiny_run_config("train.steps=1"))
        assert handler in root.handlers and empty.exists()
    finally:
        root.removeHandler(handler)
        handler.close()
    assert stat.S_ISCHR(Path("/dev/null").stat().st_mode)
