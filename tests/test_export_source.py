"""An export trusts its source only as far as the run loaded it (issue 63, item 5; and the tied head of its test
gaps): the source's index and files never lead out of it, the index's mapping is the truth, a source changed since
the run loaded it is refused, an export never lands in the run's model.init_from or a run's checkpoints, two at once
are refused, and one that is stopped or fails leaves nothing, in one line naming the file. docs/reliability.md lists
each case with its test."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import train
from models import build_args, get_spec
from models import hf_io
from models.hf_io import EXPORT_RECORD, INDEX, export_hf, export_source, export_state_dict_hf, load_hf_into_model
from tests.conftest import compose_config, file_size_limited, write_tokens

REPO = Path(__file__).resolve().parents[1]
_SCRIPT = importlib.util.spec_from_file_location("export_hf_script", REPO / "scripts" / "export_hf.py")
export_script = importlib.util.module_from_spec(_SCRIPT)
_SCRIPT.loader.exec_module(export_script)

ARCH = dict(vocab_size=256, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
VISUAL = "visual.patch_embed.weight"  # a tensor of the source the text model does not have: the export copies it


def _model(**arch) -> torch.nn.Module:
    torch.manual_seed(0)
    model = get_spec("qwen3_moe").model_cls(build_args("qwen3_moe", {**ARCH, **arch}))
    model.init_weights()
    return model


def _source(path: Path, **arch) -> Path:
    """A sharded Hugging Face directory of the tiny model, with an untrained tensor in a shard of its own (bf16, so
    that a cast would show) and a processor file."""
    export_hf(_model(**arch), "qwen3_moe", path, max_shard_bytes=40_000)
    (path / EXPORT_RECORD).unlink()
    save_file({VISUAL: torch.randn(8, 4).bfloat16()}, path / "visual.safetensors", metadata={"format": "pt"})
    index = json.loads((path / INDEX).read_text())
    index["weight_map"][VISUAL] = "visual.safetensors"
    (path / INDEX).write_text(json.dumps(index))
    (path / "preprocessor_config.json").write_text('{"patch_size": 4}\n')
    return path


def _weight_map(path: Path) -> dict[str, str]:
    return json.loads((path / INDEX).read_text())["weight_map"]


def _set_weight_map(path: Path, weight_map: dict[str, str]) -> None:
    (path / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face directory, through its index."""
    return {name: f.get_tensor(name) for file in sorted(set(_weight_map(path).values()))
            for f in [safe_open(path / file, "pt")] for name in f.keys()}


def _load(source: Path) -> None:
    load_hf_into_model(_model(), source)


def _carry(source: Path) -> None:
    model = _model()
    export_source(source, "qwen3_moe", model.args, [n for n, _ in model.named_parameters(remove_duplicate=False)])


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return _source(tmp_path_factory.mktemp("export-source") / "source")


@pytest.fixture
def source(pristine, tmp_path) -> Path:
    """A copy of the pristine source for one test to change."""
    return Path(shutil.copytree(pristine, tmp_path / "source"))


# ------------------------------------------------------------------------------------- the source's index and files
@pytest.mark.parametrize("how", ["../outside", "absolute", "a link out"])
@pytest.mark.parametrize("reader", [_load, _carry], ids=["loader", "export"])
def test_an_index_entry_or_shard_outside_the_source_is_refused(source, tmp_path, how, reader):
    weight_map = _weight_map(source)
    shard = weight_map["model.embed_tokens.weight"]
    (tmp_path / "outside").mkdir()
    moved = tmp_path / "outside" / shard
    shutil.move(source / shard, moved)
    if how == "a link out":
        (source / shard).symlink_to(moved)
    else:
        name = os.path.relpath(moved, source) if how == "../outside" else str(moved)
        _set_weight_map(source, {k: name if v == shard else v for k, v in weight_map.items()})
    with pytest.raises(ValueError, match=r"outside .*source.*a checkpoint is read only from its own directory"):
        reader(source)


@pytest.mark.parametrize("reader", [_load, _carry], ids=["loader", "export"])
def test_a_tensor_in_two_shards_is_refused_by_name(source, reader):
    """Before: the copy in the file the index does not name won (here an all-zero embedding)."""
    weight_map = _weight_map(source)
    other = next(f for f in sorted(set(weight_map.values())) if f != weight_map["model.embed_tokens.weight"])
    tensors = load_file(source / other)
    tensors["model.embed_tokens.weight"] = torch.zeros(ARCH["vocab_size"], ARCH["hidden_size"])
    save_file(tensors, source / other, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"model.embed_tokens.weight is in {other} and in "
                                         rf"{weight_map['model.embed_tokens.weight']}, which the index names"):
        reader(source)


@pytest.mark.parametrize("name", ["model.norm.weight", VISUAL])
@pytest.mark.parametrize("reader", [_load, _carry], ids=["loader", "export"])
def test_a_tensor_the_index_names_but_its_shard_lacks_is_refused(source, reader, name):
    """Before: the export dropped an untrained tensor so missing without a word."""
    shard = source / _weight_map(source)[name]
    tensors = load_file(shard)
    del tensors[name]
    tensors.setdefault("padding", torch.zeros(1))  # safetensors needs one tensor; the index lists none such
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{name} is not in {shard.name}, where the index puts it"):
        reader(source)


def test_a_hub_cache_snapshot_whose_files_link_into_its_blobs_loads(pristine, tmp_path):
    """huggingface_hub's cache: snapshots/<revision>/<file> -> ../../blobs/<hash>, the one way out allowed."""
    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted(pristine.iterdir())):
        shutil.copy(file, repo / "blobs" / f"blob{i}")
        (snapshot / file.name).symlink_to(Path("../../blobs") / f"blob{i}")
    _load(snapshot)
    _carry(snapshot)


def test_a_link_out_of_the_source_is_not_copied_and_permissions_are_not_widened(source, tmp_path):
    secret = tmp_path / "shadow"
    secret.write_text("root:$6$secret\n")
    secret.chmod(0o600)
    (source / "preprocessor_config.json").unlink()
    (source / "preprocessor_config.json").symlink_to(secret)
    model = _model()
    with pytest.raises(ValueError, match=rf"{source / 'preprocessor_config.json'} is a symbolic link to {secret}, "
                                         r"outside the source directory"):
        export_state_dict_hf(model.state_dict(), "qwen3_moe", model.args, tmp_path / "hf", source=source)
    assert not (tmp_path / "hf").exists()
    (source / "preprocessor_config.json").unlink()
    (source / "preprocessor_config.json").write_text("{}\n")
    (source / "preprocessor_config.json").chmod(0o600)  # a private file of the source stays private
    export_state_dict_hf(model.state_dict(), "qwen3_moe", model.args, tmp_path / "hf", source=source)
    assert stat.S_IMODE((tmp_path / "hf" / "preprocessor_config.json").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "hf" / "config.json").stat().st_mode) & 0o044 == 0o044 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ------------------------------------------------------------------------------------- a source changed since the run
@pytest.fixture(scope="module")
def trained(pristine, tmp_path_factory) -> Path:
    """A run from ``pristine`` (model=hf): 2 steps, a checkpoint at each, the final weights."""
    base = tmp_path_factory.mktemp("from-source")
    write_tokens(base / "tokens.npy", 2048)
    train.run(compose_config([
        "model=hf", f"model.init_from={pristine}", "model.tokenizer=none", "data=tokens",
        f"data.path={base / 'tokens.npy'}", "data.seq_len=16", f"data.cache_dir={base / 'cache'}",
        f"train.output_dir={base / 'run'}", "train.steps=2", "checkpoint.interval=1", "train.local_batch_size=2",
        "logging.tensorboard=false", "train.device=cpu", "train.mixed_precision=fp32"]))
    return base / "run"


def _rewrite(path: Path, change) -> None:
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize("change", ["untrained tensor", "processor file"])
@pytest.mark.parametrize("exported", ["final weights", "checkpoint"])
def test_a_source_changed_since_the_run_loaded_it_is_refused(trained, pristine, tmp_path, change, exported):
    """Before: the export put the new tensors beside a model trained from the old ones."""
    weights = trained if exported == "final weights" else trained / "checkpoints" / "step_00000002"
    same = Path(shutil.copytree(pristine, tmp_path / "same"))
    export_script.main([str(weights), str(tmp_path / "ok"), "--source", str(same)])  # a copy of what it loaded
    assert torch.equal(_tensors(tmp_path / "ok")[VISUAL], load_file(pristine / "visual.safetensors")[VISUAL])
    changed = Path(shutil.copytree(pristine, tmp_path / "changed"))
    if change == "untrained tensor":
        _rewrite(changed / "visual.safetensors", lambda t: t.update({VISUAL: t[VISUAL] + 1}))  # same size
        what = "the 1 tensors the run does not train"
    else:
        (changed / "preprocessor_config.json").write_text('{"patch_size": 8}\n')
        what = "preprocessor_config.json"
    with pytest.raises(ValueError, match=rf"the source {changed} is not what the run loaded from "
                                         rf"model.init_from={pristine}: {what} \(?.*changed since"):
        export_script.main([str(weights), str(tmp_path / "hf"), "--source", str(changed)])
    assert not (tmp_path / "hf").exists()


# ------------------------------------------------------------------------------------- where an export may go
def test_an_export_into_the_runs_init_from_or_checkpoints_is_refused(trained, pristine, tmp_path):
    """Before: the first replaced the model the run started from without a word (an earlier export of it, here), the
    second was taken for a damaged checkpoint by the next resume."""
    before = {p.name: p.read_bytes() for p in pristine.iterdir()}
    (pristine / EXPORT_RECORD).write_text(json.dumps({"files": sorted(before)}))  # an earlier export: replaceable
    try:
        for source in ([], ["--source", "none"]):
            with pytest.raises(ValueError, match=rf"export directory {pristine} is the run's model.init_from"):
                export_script.main([str(trained), str(pristine), *source])
    finally:
        (pristine / EXPORT_RECORD).unlink()
    assert {p.name: p.read_bytes() for p in pristine.iterdir()} == before
    for out in (trained / "checkpoints" / "step_00000009", trained / "checkpoints" / "hf",
                trained / "checkpoints" / "step_00000001" / "hf"):
        with pytest.raises(ValueError, match=rf"export directory {out} is or lies inside .*checkpoints.*choose a "
                                             "directory outside it"):
            export_script.main([str(trained), str(out)])
        assert not out.exists()


def test_a_second_export_into_a_directory_being_written_is_refused(tmp_path):
    model = _model()
    out = tmp_path / "hf"
    with hf_io._export_lock(out):  # the first export, still writing
        with pytest.raises(ValueError, match=rf"export directory {out} is being written by another export "
                                             rf"\(pid {os.getpid()} on "):
            export_state_dict_hf(model.state_dict(), "qwen3_moe", model.args, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # neither the export nor its lock file
    export_state_dict_hf(model.state_dict(), "qwen3_moe", model.args, out)  # free again
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


# ------------------------------------------------------------------------------------- an export stopped or failing
_STOPPED = """
import os, signal, sys, torch
sys.path.insert(0, {repo!r})
from models import build_args, get_spec
import models.hf_io as hf_io
from training.launch import one_line_errors
write = hf_io.write_safetensors
def write_then_stop(*args, **kwargs):  # SIGTERM once the first shard is written
    write(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGTERM)
hf_io.write_safetensors = write_then_stop
model = get_spec("qwen3_moe").model_cls(build_args("qwen3_moe", {arch!r}))
with one_line_errors():
    hf_io.export_state_dict_hf(model.state_dict(), "qwen3_moe", model.args, {out!r}, max_shard_bytes=40_000)
"""


def test_sigterm_mid_export_removes_its_temporary_folder_and_says_so_in_one_line(tmp_path):
    """Before: killed without a line, its .hf.tmp-<pid>-* folder left."""
    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-c", _STOPPED.format(repo=str(REPO), arch=ARCH, out=str(out))],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 130 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0] == (f"interrupted: SIGTERM: the export to {out} stopped; its temporary folder was removed and "
                        f"{out} is as it was")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_full_disk_names_the_file_and_leaves_nothing(tmp_path):
    """Before: a bare [Errno 27] File too large, without the file."""
    model = _model()
    export = file_size_limited(lambda out, _: export_state_dict_hf(model.state_dict(), "qwen3_moe", model.args, out,
                                                                   max_shard_bytes=40_000), 30_000)
    with pytest.raises(hf_io.ExportError, match=rf"no space or file too large while writing {tmp_path / 'hf'}/"
                                          r"model-00001-of-0000\d\.safetensors: file too large .*nothing of the "
                                          rf"export was kept \({tmp_path / 'hf'} is as it was\)"):
        export(tmp_path / "hf", None)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------- a tied model's stale head
def test_a_tied_model_from_a_source_storing_lm_head_neither_loads_nor_exports_the_stale_head(tmp_path):
    """A tied source (tie_word_embeddings) whose safetensors also hold an lm_head.weight unlike its embedding (as
    transformers, which ties after loading, ignores it): the run's head is the source's embedding, and the export
    writes no lm_head.weight of the source's beside the trained embedding."""
    source = _source(tmp_path / "source", tie_word_embeddings=True)
    shard = source / _weight_map(source)["model.embed_tokens.weight"]
    stale = torch.full((ARCH["vocab_size"], ARCH["hidden_size"]), 0.5)
    _rewrite(shard, lambda t: t.update({"lm_head.weight": stale}))
    index = _weight_map(source)
    _set_weight_map(source, {**index, "lm_head.weight": shard.name})
    embedding = load_file(shard)["model.embed_tokens.weight"]
    model = _model(tie_word_embeddings=True)
    load_hf_into_model(model, source)
    assert model.lm_head.weight is model.model.embed_tokens.weight and torch.equal(model.lm_head.weight, embedding)

    write_tokens(tmp_path / "tokens.npy", 2048)
    train.run(compose_config([
        "model=hf", f"model.init_from={source}", "model.tokenizer=none", "data=tokens",
        f"data.path={tmp_path / 'tokens.npy'}", "data.seq_len=16", f"data.cache_dir={tmp_path / 'cache'}",
        f"train.output_dir={tmp_path / 'run'}", "train.steps=1", "train.local_batch_size=2", "optim.warmup_steps=0",
        "logging.tensorboard=false", "train.device=cpu", "train.mixed_precision=fp32",
        "checkpoint.export_hf_at_end=true", "checkpoint.at_end=false"]))
    hf = tmp_path / "run" / "hf"
    exported = _tensors(hf)
    trained = load_file(tmp_path / "run" / "model.safetensors")["model.embed_tokens.weight"]
    assert "lm_head.weight" not in exported and torch.equal(exported["model.embed_tokens.weight"], trained)
    assert not torch.equal(trained, embedding)  # it trained
    assert json.loads((hf / "config.json").read_text())["tie_word_embeddings"] is True
