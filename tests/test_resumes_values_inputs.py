"""Issue 63, round 4 (resumes, values and inputs): a resume applies and lists every model.arch override or refuses
it by name, on every model config (the presets and model=hf, which takes the training knobs as keys); a run that
would train nothing, and values no optimizer should take, are refused at start-up naming the key; a deep JSON line,
a directory or FIFO as data.path, pretokenize's output that is a file and a !!python tag in a run's config.yaml are
one readable line. docs/reliability.md lists each case with its test."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

import train
from scripts import export_hf as export_script
from scripts import pretokenize
from tests.conftest import compose_config, write_chats, write_tokens
from training import startup
from training.checkpoint import CheckpointError, read_train_state
from training.config import validate
from training.data.config import DataConfig, validate_data_config
from training.data.loader import build_data_loader
from training.data.tokenize_shards import tokenize_to_shards
from training.launch import one_line_errors
from training.run_dir import find_start

REPO = Path(__file__).resolve().parents[1]
QWEN35_TINY = ["model=qwen35_moe_debug", "model.arch.vocab_size=256", "model.arch.hidden_size=32",
               "model.arch.moe_intermediate_size=16", "model.arch.shared_expert_intermediate_size=16"]
# What the runs trained with, away from every default: a resume that drops one of them shows.
TRAINED = {"mtp_loss_weight": 0.3, "router_aux_loss_coef": 0.002, "router_z_loss_coef": 0.01}
KNOBS = ["mtp_loss_weight", "router_aux_loss_coef", "router_z_loss_coef", "router_bias_update_rate",
         "router_force_balance"]


# ------------------------------------------------------------------------------------- 1: resumes drop overrides
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A Qwen3.5 source with an MTP head (an export), and one checkpointed step of each model config trained from
    it at TRAINED: model=hf, a preset with model.init_from, a preset alone. ``config(kind, *overrides)`` composes a
    start of that run."""
    base = tmp_path_factory.mktemp("round4")
    write_tokens(base / "tokens.npy", 2048)
    common = ["data=tokens", f"data.path={base / 'tokens.npy'}", "data.seq_len=16", f"data.cache_dir={base / 'cache'}",
              "train.local_batch_size=2", "logging.tensorboard=false", "train.device=cpu"]
    train.run(compose_config([*QWEN35_TINY, *common, "model.arch.mtp_loss_weight=0.3", "train.steps=0",
                              "checkpoint.export_hf_at_end=true", f"train.output_dir={base / 'source'}"]))
    source = base / "source" / "hf"
    kinds = {"hf": ["model=hf", f"model.init_from={source}"],
             "preset_init_from": [*QWEN35_TINY, f"model.init_from={source}"], "preset": QWEN35_TINY}

    def config(kind: str, *overrides: str):
        return compose_config([*kinds[kind], *common, *(f"model.arch.{k}={v}" for k, v in TRAINED.items()),
                               f"train.output_dir={base / kind}", "train.steps=1", *overrides])

    for kind in kinds:
        train.run(config(kind))
    config.source = source
    return config


def _compare(plan: startup.RunPlan) -> None:
    """What RunPlan.hold does with a resume's config: list every difference, refuse what allow_changes does not name."""
    startup.check_resumed_config(plan.start.state, plan.run_config, plan.global_batch, plan.cfg.train.allow_changes,
                                 plan.start.checkpoint, log=True)


@pytest.mark.parametrize("kind, key, new", [
    *((kind, key, new) for kind in ("hf", "preset_init_from") for key, new in (
        ("mtp_loss_weight", 0.5), ("router_aux_loss_coef", 0.004), ("router_z_loss_coef", 0.02),
        ("rms_norm_eps", 1e-5))),  # a key of the architecture, not a knob: compared the same way
    ("preset", "mtp_loss_weight", 0.5),
])
def test_a_resume_applies_and_lists_a_model_arch_change_or_refuses_it_by_name(runs, kind, key, new, caplog):
    """Before: with model=hf (and a preset with model.init_from) the resume built the checkpoint's architecture, the
    override neither listed nor applied, even with train.allow_changes naming it."""
    old = TRAINED.get(key, 1e-6)
    plus = "+" if kind == "hf" and key not in KNOBS else ""  # conf/model/hf.yaml lists the knobs alone
    cfg = runs(kind, f"{plus}model.arch.{key}={new}", "train.resume=auto")
    plan = startup.plan_run(cfg, startup.World(1))
    assert plan.start.checkpoint is not None
    change = re.escape(f"model.arch.{key}: {old!r} -> {new!r}")
    with pytest.raises(ValueError, match=rf"would change what is trained: {change}.*"
                                         rf"train\.allow_changes=\[model\.arch\.{key}\]"):
        _compare(plan)
    allowed = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, allow_changes=[f"model.arch.{key}"]))
    plan = startup.plan_run(allowed, startup.World(1))
    assert getattr(plan.model_args, key) == new and plan.run_config["model"]["arch"][key] == new  # built, recorded
    with caplog.at_level("INFO", logger="train"):
        _compare(plan)
    assert re.search(rf"config differs from checkpoint \S+: {change}", caplog.text)


def test_a_model_hf_resume_trains_with_the_changed_mtp_weight_and_refuses_dropping_the_head(runs, tmp_path, caplog):
    """The issue's case end to end: model=hf trained at mtp_loss_weight=0.3, resumed at 0.5 with train.allow_changes
    naming it: the resumed steps' checkpoint records 0.5 (the model was built with it). A weight of 0 (no head) is
    refused: the checkpoint holds the head, named tensor by tensor."""
    def config(*overrides: str):
        return dataclasses.replace(cfg := runs("hf", *overrides), train=dataclasses.replace(
            cfg.train, output_dir=str(tmp_path / "run")))

    train.run(config("checkpoint.interval=1"))
    allow = "train.allow_changes=[train.steps,model.arch.mtp_loss_weight]"
    with caplog.at_level("INFO", logger="train"):
        train.run(config("train.steps=2", "train.resume=auto", "model.arch.mtp_loss_weight=0.5", allow))
    assert "model.arch.mtp_loss_weight: 0.3 -> 0.5" in caplog.text
    state = read_train_state(tmp_path / "run" / "checkpoints" / "step_00000002")
    assert state["config"]["model"]["arch"]["mtp_loss_weight"] == 0.5
    with pytest.raises(CheckpointError, match=r"does not match this model/optimizer: not in the model \(\d+\): "
                                              r"model\.mtp\.fc\.weight"):
        train.run(config("train.steps=3", "train.resume=auto", "model.arch.mtp_loss_weight=0", allow))


@pytest.mark.parametrize("key, value", [("mtp_loss_weight", 0.3), ("router_aux_loss_coef", 0.01),
                                        ("router_z_loss_coef", 0.001), ("router_bias_update_rate", 0.001),
                                        ("router_force_balance", True)])
def test_model_hf_takes_the_training_knobs_without_a_plus_as_the_presets_do(key, value):
    """Before: Hydra refused model.arch.mtp_loss_weight=0.3 with model=hf (no such key) unless written with a +."""
    assert compose_config(["model=hf", "model.init_from=x", f"model.arch.{key}={value}"]).model.arch[key] == value


def test_the_hf_preset_lists_every_familys_training_knobs_as_null():
    import models

    arch = yaml.safe_load((REPO / "conf" / "model" / "hf.yaml").read_text())["arch"]
    assert arch == {name: None for name in models.all_training_knobs()} and set(KNOBS) == set(arch)


def test_a_model_hf_model_type_that_is_not_config_jsons_is_refused(runs, tmp_path):
    cfg = runs("hf", "model.model_type=qwen3_moe", f"train.output_dir={tmp_path / 'run'}")
    with pytest.raises(ValueError, match=r"model\.model_type=qwen3_moe with model=hf, whose model_type is "
                                         r"config\.json's: .*/config\.json is qwen3_5_moe"):
        startup.plan_run(cfg, startup.World(1))


# ------------------------------------------------------------------------------------- 2: training that trains nothing
def test_the_mtp_head_with_windows_too_short_for_its_pairs_is_refused(tiny_run_config):
    """Before: data.seq_len=1 with the MTP head logged an MTP loss of 0.0000 at every step, exit code 0."""
    cfg = tiny_run_config(*QWEN35_TINY, "model.arch.mtp_loss_weight=0.3", "data.seq_len=1")
    with pytest.raises(ValueError, match=r"model\.arch\.mtp_loss_weight=0\.3 trains the MTP head on token t\+2 .* "
                                         r"data\.seq_len=1 windows \(2 tokens\) hold no such pair"):
        startup.plan_run(cfg, startup.World(1))
    startup.plan_run(tiny_run_config(*QWEN35_TINY, "model.arch.mtp_loss_weight=0.3", "data.seq_len=2"),
                     startup.World(1))


@pytest.mark.parametrize("override", ["model.arch.mtp_loss_weight=nan", "model.arch.router_z_loss_coef=nan",
                                      "model.arch.router_aux_loss_coef=nan", "model.arch.router_bias_update_rate=inf",
                                      "model.arch.rope_theta=nan", "dispatcher.capacity_factor=inf",
                                      "data.sources=[{path: x, weight: inf}]"])
def test_a_non_finite_knob_is_refused_not_read_as_off(override):
    """Before: a nan weight or coefficient passed every check (nan < 0 is false) and then meant "off" (nan > 0 is
    false too). Every float key of the config is refused when it is not finite, the architecture's too."""
    key = override.split("=")[0].replace("data.sources", "data.sources[0].weight")
    with pytest.raises(ValueError, match=rf"^{re.escape(key)}=(nan|inf) must be a finite number"):
        validate(compose_config(["model=qwen35_moe_debug", override]))


def test_a_non_finite_value_from_config_json_is_refused_by_key():
    import models

    with pytest.raises(ValueError, match=r"model\.arch\.rope_theta=nan must be a finite number"):
        models.build_args("qwen3_moe", {"rope_theta": float("nan")})


def test_token_shards_whose_every_label_is_masked_are_refused_under_mask_non_assistant(tmp_path):
    """A pre-tokenized (ids, mask) shard with no trained label: data.mask_non_assistant=true trained nothing (the
    jsonl and datasets paths refused it already)."""
    ids = np.arange(4096, dtype=np.uint32) % 200
    np.save(tmp_path / "none.npy", np.stack([ids, np.zeros_like(ids)]))
    cfg = DataConfig(name="tokens", path=str(tmp_path / "none.npy"), seq_len=16, mask_non_assistant=True,
                     cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"data\.path=\S+none\.npy: every label of its shards is masked"):
        build_data_loader(cfg, seed=0, local_batch_size=2, dp_rank=0, dp_size=1, tokenizer=None)
    mask = np.zeros_like(ids)
    mask[-1] = 1  # one trained label, at the very end: read up to it
    np.save(tmp_path / "one.npy", np.stack([ids, mask]))
    build_data_loader(dataclasses.replace(cfg, path=str(tmp_path / "one.npy")), seed=0, local_batch_size=2,
                      dp_rank=0, dp_size=1, tokenizer=None)


# ------------------------------------------------------------------------------------- 3: values no optimizer takes
@pytest.mark.parametrize("overrides, says", [
    (["optim.weight_decay=-0.1"], r"optim\.weight_decay=-0\.1 must be >= 0"),
    (["optim.lr=inf"], r"optim\.lr=inf must be a finite number"),
    (["optim.lr=1e30"], r"optim\.lr=1e\+30 is too large: AdamW moves every weight by about lr a step"),
    (["optim.lr=1.0"], r"optim\.lr=1 is too large"),
    (["optim.lr=1e-300"], r"optim\.lr=1e-300 is below the smallest float32 \(1\.4e-45\)"),
    (["optim.warmup_steps=1000000000000"], r"optim\.warmup_steps=1,000,000,000,000 is absurd"),
    (["optim.lr=0.5", "optim.weight_decay=2"], r"optim\.lr=0\.5 x optim\.weight_decay=2 >= 1"),
    (["optim.weight_decay=nan"], r"optim\.weight_decay=nan must be a finite number"),
    (["optim.betas=[nan,0.95]"], r"optim\.betas\[0\]=nan must be a finite number"),
    (["optim.betas=[0.9,1.0]"], r"optim\.betas=\[0\.9, 1\.0\]: each must be in \[0, 1\)"),
    (["optim.eps=inf"], r"optim\.eps=inf must be a finite number"),
    (["optim.eps=0"], r"optim\.eps=0\.0 must be positive"),
    (["optim.grad_clip=inf"], r"optim\.grad_clip=inf must be a finite number \(optim\.grad_clip <= 0: no clipping\)"),
    (["train.steps=1000000000000"], r"train\.steps=1,000,000,000,000 is absurd: more than 1,000,000,000"),
    (["train.steps=100000000", "train.local_batch_size=64", "data.seq_len=262144"],
     r"train\.steps=100,000,000 trains at least 1\.68e\+15 tokens .*more than 1e15"),
])
def test_values_no_optimizer_should_take_are_refused_at_start_up_naming_the_key(overrides, says):
    """Before: a negative weight decay was applied, lr=inf or 1e30 died inside the first steps without naming the
    key (and left a folder that blocked the retry), and train.steps=1e12 started with an ETA of 216 million hours."""
    with pytest.raises(ValueError, match=rf"^{says}"):
        validate(compose_config(overrides))


def test_a_giant_lr_writes_nothing_and_the_corrected_retry_starts(tiny_run_config):
    cfg = tiny_run_config("train.steps=1", "optim.lr=1e30")
    with pytest.raises(ValueError, match=r"optim\.lr=1e\+30 is too large"):
        train.run(cfg)
    assert not Path(cfg.train.output_dir).exists()
    assert [m["step"] for m in train.run(tiny_run_config("train.steps=1"))] == [1]


def test_a_run_that_fails_inside_step_1_does_not_block_the_retry(tiny_run_config, tmp_path):
    """training/run_dir.py's rule for a run that fails inside its first step (here weights initialised at std 1e15:
    step 1's gradients overflow to nan, train.nonfinite=stop): no record of a step, no checkpoint, no metric line,
    so the corrected retry starts in the same directory."""
    with pytest.raises(FloatingPointError, match=r"non-finite loss=\S+ or grad_norm=nan"):
        train.run(tiny_run_config("train.steps=2", "model.arch.initializer_range=1e15"))
    run_dir = tmp_path / "run"
    assert run_dir.is_dir() and not (run_dir / "checkpoints").exists()
    assert find_start("none", False, run_dir / "checkpoints", run_dir).checkpoint is None  # no run: a retry starts
    assert [m["step"] for m in train.run(tiny_run_config("train.steps=2"))] == [1, 2]


# ------------------------------------------------------------------------------------- WEAK: one readable line
def test_a_json_line_nested_100000_deep_names_the_file_and_line(tmp_path):
    """Before: a RecursionError traceback with no file or line (data=jsonl, scripts/pretokenize.py)."""
    path = write_chats(tmp_path / "chats.jsonl", 3)
    with path.open("a") as f:
        f.write('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))} line 4: JSON nested deeper than the parser reads"):
        tokenize_to_shards(path, tmp_path / "out", "qwen3")
    chitchat = tmp_path / "dataset.json"
    chitchat.write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    cfg = DataConfig(name="chitchat", path=str(chitchat), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(chitchat))}: JSON nested deeper than the parser reads"):
        build_data_loader(cfg, seed=0, local_batch_size=1, dp_rank=0, dp_size=1)


@pytest.mark.parametrize("name", ["jsonl", "chitchat", "tokens", "hf"])
@pytest.mark.parametrize("kind", ["directory", "a FIFO"])
def test_a_directory_or_fifo_as_data_path_is_named_as_such(tmp_path, name, kind):
    """Before: "no such file". A FIFO is never opened (that would wait for a writer)."""
    path = tmp_path / "x"
    path.mkdir() if kind == "directory" else os.mkfifo(path)
    if kind == "directory" and name in ("tokens", "hf"):  # a directory is theirs to read: one without their files
        says = r"holds no"
    elif kind == "directory":
        says = rf"is a directory, and data\.name={name} reads one"
    else:
        says = r"is a FIFO, not a "
    with pytest.raises(ValueError, match=rf"^data\.path={re.escape(str(path))}:? {says}"):
        validate_data_config(DataConfig(name=name, path=str(path)))


def test_pretokenize_into_a_file_is_one_line(tmp_path, monkeypatch, capsys):
    """Before: a bare `FileExistsError: [Errno 17] File exists`; the trainer's data.cache_dir the same (before: the
    Errno 17 inside "could not write the tokenized-corpus cache ... Free space there")."""
    source, out = write_chats(tmp_path / "chats.jsonl", 4), tmp_path / "out"
    out.write_text("mine")
    monkeypatch.setattr(sys, "argv", ["pretokenize.py", str(source), str(out), "--workers", "1", "--no-progress"])
    with pytest.raises(SystemExit) as exit_:
        pretokenize.main()
    assert exit_.value.code == 1 and out.read_text() == "mine"
    assert capsys.readouterr().err.splitlines()[0] == (
        f"error: ValueError: the token shards' directory {out} is a file, not a directory: name a new or empty "
        "directory (or that of an earlier run of this tokenization, which it continues)")
    for inside in (out / "shards", tmp_path / "fifo"):  # under a file; a FIFO
        if inside.name == "fifo":
            os.mkfifo(inside)
        with pytest.raises(ValueError, match=rf"the token shards' directory {re.escape(str(inside))} "
                                             r"(cannot be made: \S+ is a file|is a FIFO), not a directory"):
            tokenize_to_shards(source, inside, "qwen3")
    with pytest.raises(ValueError, match=rf"^data\.cache_dir={re.escape(str(out))} is a file, not a directory"):
        validate_data_config(DataConfig(path=str(source), name="jsonl", cache_dir=str(out)))


def _tagged_config(run_dir: Path, marker: Path) -> Path:
    """A run's config.yaml whose train.seed is a !!python tag that would run a command if constructed."""
    run_dir.mkdir(parents=True, exist_ok=True)
    config = run_dir / "config.yaml"
    config.write_text("# Re-run: python train.py (the header of a run's config.yaml: a run of this trainer)\n"
                      "defaults:\n- schema\n- _self_\ntrain:\n"
                      f"  seed: !!python/object/apply:os.system ['touch {marker}']\n")
    return config


def test_a_python_tag_in_a_runs_config_yaml_is_one_line_and_runs_nothing(tmp_path, tiny_run_config, capsys):
    """Before: nothing ran, but a 20- to 60-line traceback: as Hydra's primary config (the real entry point), read
    by train.resume=auto from a run without a checkpoint, and by scripts/export_hf.py."""
    marker = tmp_path / "ran"
    config = _tagged_config(tmp_path / "run", marker)
    line = (f"{config} line 6, column 9: could not determine a constructor for the tag "
            "'tag:yaml.org,2002:python/object/apply:os.system' (a tag that builds a Python object")
    done = subprocess.run([sys.executable, "train.py", "--config-path", str(tmp_path / "run"), "--config-name",
                           "config", "train.resume=auto"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.splitlines()[0].startswith(f"error: ConstructorError: {line}"), done.stderr
    (tmp_path / "run" / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")  # a run was here
    (tmp_path / "run" / "model.safetensors").write_bytes(b"")
    for read in (lambda: train.run(tiny_run_config("train.resume=auto")),
                 lambda: export_script.run_config(tmp_path / "run")):
        with pytest.raises(SystemExit) as exit_, one_line_errors():
            read()
        assert exit_.value.code == 1
        err = capsys.readouterr().err
        assert err.startswith(f"error: ConstructorError: {line}") and len(err.splitlines()) == 2, err
    assert not marker.exists()
