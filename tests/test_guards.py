"""Nothing of a run is lost and nothing wrong is trained without a sign (issue 31, cases 1 and 6-9): an export never
replaces a run or a folder that is not an earlier export; data changed under a resume is refused; a damaged or
swapped cache file or token shard is found and named; corpora that train on (almost) only special tokens are
refused; integer tensors are not cast into floating parameters. docs/reliability.md lists each case."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import train
from models import build_args, get_spec
from models.hf_io import EXPORT_RECORD, export_state_dict_hf, load_hf_into_model, load_into_model
from tests.conftest import TINY_MODEL, compose_config, write_tokens

REPO = Path(__file__).resolve().parents[1]


def _export_script():
    spec = importlib.util.spec_from_file_location("export_hf_script", REPO / "scripts" / "export_hf.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A 2-step run with a checkpoint at step 2, trained once for this module."""
    base = tmp_path_factory.mktemp("finished")
    write_tokens(base / "tokens.npy", 4096)
    train.run(compose_config([*TINY_MODEL, "data=tokens", f"data.path={base / 'tokens.npy'}", "data.seq_len=32",
                              f"data.cache_dir={base / 'cache'}", f"train.output_dir={base / 'run'}",
                              "train.local_batch_size=2", "logging.tensorboard=false", "train.steps=2",
                              "checkpoint.interval=2", "train.device=cpu"]))
    return base / "run"


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------- 1. export
def test_an_export_never_replaces_a_run_its_parent_or_a_foreign_folder(finished_run, tmp_path):
    runs = tmp_path / "runs"
    run = runs / "a"
    shutil.copytree(finished_run, run)
    shutil.copytree(finished_run, runs / "b")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    before = _tree(tmp_path)
    # OUT == RUN, from the command line: one line, exit 1, the run intact (before: only the HF files were left)
    out = subprocess.run([sys.executable, "scripts/export_hf.py", str(run), str(run)], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"{run} is not an earlier export (it holds checkpoints, config.yaml" in errors[0]
    script = _export_script()
    for target in (runs, tmp_path / "mine", run / "checkpoints" / "step_00000002", run / "config.yaml"):
        with pytest.raises(ValueError, match=rf"export directory {target} is (not an earlier export|a file)"):
            script.main([str(run), str(target)])
    assert _tree(tmp_path) == before

    # A new directory gets an export and its record; exporting again replaces it; a file added to it is kept.
    hf = tmp_path / "hf"
    script.main([str(run), str(hf)])
    assert (hf / EXPORT_RECORD).is_file() and (hf / "config.json").is_file()
    script.main([str(run / "checkpoints" / "step_00000002"), str(hf)])
    (hf / "README.md").write_text("model card")
    with pytest.raises(ValueError, match=r"an earlier export with other files added \(it holds README\.md\)"):
        script.main([str(run), str(hf)])
    assert (hf / "README.md").read_text() == "model card"


def test_export_hf_at_end_is_checked_before_training(tiny_run_config):
    cfg = tiny_run_config("train.steps=1", "checkpoint.export_hf_at_end=true")
    hf = Path(cfg.train.output_dir) / "hf"
    hf.mkdir(parents=True)
    (hf / "weights.bin").write_bytes(b"someone's")
    with pytest.raises(ValueError, match=rf"export directory {hf} is not an earlier export \(it holds weights.bin"):
        train.run(cfg)
    assert not (Path(cfg.train.output_dir) / "metrics.jsonl").exists()
    (hf / "weights.bin").unlink()
    train.run(cfg)
    train.run(tiny_run_config("train.steps=1", "checkpoint.export_hf_at_end=true", "train.resume=auto"))  # replaced
    assert (hf / EXPORT_RECORD).is_file()


# ------------------------------------------------------------------------------------- 9. init_from dtypes
ARCH = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)


def _tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = get_spec("qwen3_moe").model_cls(build_args("qwen3_moe", ARCH))
    model.init_weights()
    return model


@pytest.mark.parametrize("disk_name,ours", [
    ("model.norm.weight", "model.norm.weight"),
    ("model.layers.0.mlp.experts.1.up_proj.weight", "model.layers.0.mlp.experts.gate_up_proj"),  # a fused part
])
def test_an_integer_tensor_for_a_floating_parameter_is_refused_by_name(tmp_path, disk_name, ours):
    model = _tiny_model()
    export_state_dict_hf(model.state_dict(), "qwen3_moe", model.args, tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].bfloat16()  # a float cast loads
    shape = tensors[disk_name].shape
    tensors[disk_name] = torch.tensor([2, -1, 0, 1, 5], dtype=torch.int8).repeat(shape.numel())[:shape.numel()] \
        .reshape(shape)  # the issue's values: before, they loaded as 2.0, -1.0, ...
    save_file(tensors, weights, metadata={"format": "pt"})
    target = _tiny_model()
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ValueError, match=rf"not floating-point .*: {ours} \(I8 for a float32 parameter\)"):
        load_hf_into_model(target, tmp_path / "hf")
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())  # nothing copied
    with pytest.raises(ValueError, match=rf"{ours} \(int8 for a float32 parameter\)"):
        load_into_model(target, {**model.state_dict(), ours: model.state_dict()[ours].to(torch.int8)})
