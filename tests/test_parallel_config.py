"""The parallel config: presets compose and validate, the sizes are top-level keys and the backend config is strict,
and every bad topology fails before any process group with the key, the numbers and a fix."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException

import train
from parallelisms import BackendConfig, ParallelConfig, build_parallel_dims, resolve_sizes, validate_parallel_config
from tests.conftest import CONF_DIR, compose_config

PRESETS = sorted(p.stem for p in Path(CONF_DIR, "parallel").glob("*.yaml"))
# The world size each preset is meant for (8 unless listed).
WORLD = {"single": 1, "ep16": 16, "cp2_ep4_efsdp2": 16}
HEADS = [("num_attention_heads", 32, "num_key_value_heads", 4)]  # Qwen3-30B-A3B: what context parallelism checks


def _cfg(**kwargs) -> ParallelConfig:
    backend = {k: kwargs.pop(k) for k in list(kwargs) if k in BackendConfig.__dataclass_fields__}
    return ParallelConfig(**kwargs, backend=BackendConfig(**backend))


def test_every_preset_is_there_and_documented_in_one_line():
    assert set(PRESETS) == {"single", "ddp", "fsdp2", "hsdp", "ep2", "ep4", "ep8", "ep16", "ep4_efsdp2", "ep2_edp2",
                            "cp2", "cp4", "cp2_ep2_efsdp2", "cp2_ep2_edp2", "cp2_ep4_efsdp2"}
    for preset in PRESETS:
        lines = Path(CONF_DIR, "parallel", f"{preset}.yaml").read_text().splitlines()
        assert lines[0].startswith("# ") and not lines[1].startswith("#"), preset
        assert not any("dispatcher" in line for line in lines), preset  # the dispatcher group is read by the code


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_composes_and_validates_at_its_world_size(preset):
    composed = compose_config([f"parallel={preset}"])
    cfg = composed.parallel
    assert cfg.name == preset and composed.dispatcher.name == "fused"
    validate_parallel_config(cfg, WORLD.get(preset, 8), 128, heads=HEADS, seq_len=4096)


def test_exactly_the_parity_tested_presets_fit_8_ranks():
    from tests.test_context_parallel import PRESETS as CP_PRESETS
    from tests.test_parallel_parity import FITTING_PRESETS

    fitting = []
    for preset in PRESETS:
        try:
            validate_parallel_config(compose_config([f"parallel={preset}"]).parallel, 8, 8, heads=HEADS, seq_len=64)
            fitting.append(preset)
        except (ValueError, NotImplementedError):  # single (one process), ep16 and cp2_ep4_efsdp2 (16 ranks)
            pass
    assert sorted(fitting) == sorted(FITTING_PRESETS + CP_PRESETS)


def test_expert_layout_of_the_presets_on_8_and_16_ranks():
    shapes = {p: resolve_sizes(compose_config([f"parallel={p}"]).parallel, 8).expert_mesh_shape
              for p in ("fsdp2", "ep2", "ep4", "ep8", "ep4_efsdp2", "ep2_edp2")}
    assert shapes == {"fsdp2": (1, 8, 1, 1), "ep2": (1, 4, 2, 1), "ep4": (1, 2, 4, 1), "ep8": (1, 1, 8, 1),
                      "ep4_efsdp2": (1, 2, 4, 1), "ep2_edp2": (2, 2, 2, 1)}
    assert resolve_sizes(compose_config(["parallel=ep4_efsdp2"]).parallel, 16).expert_mesh_shape == (2, 2, 4, 1)
    assert resolve_sizes(compose_config(["parallel=cp2_ep4_efsdp2"]).parallel, 16).expert_mesh_shape == (1, 2, 4, 2)
    cp_shapes = {p: resolve_sizes(compose_config([f"parallel={p}"]).parallel, 8).expert_mesh_shape
                 for p in ("cp2", "cp4", "cp2_ep2_efsdp2", "cp2_ep2_edp2")}
    assert cp_shapes == {"cp2": (1, 4, 1, 2), "cp4": (1, 2, 1, 4), "cp2_ep2_efsdp2": (1, 2, 2, 2),
                         "cp2_ep2_edp2": (2, 1, 2, 2)}


def test_backend_config_is_strict_about_unknown_keys():
    # A topology key put inside the backend is an error, never silently ignored.
    with pytest.raises(ConfigCompositionException, match="cp_size"):
        compose_config(["parallel=ep2", "parallel.backend.cp_size=2"])
    with pytest.raises(ConfigCompositionException, match="ep_sise"):
        compose_config(["parallel=ep2", "parallel.backend.ep_sise=4"])
    with pytest.raises(ConfigCompositionException, match="ep_size"):
        compose_config(["parallel=ep2", "parallel.backend.ep_size=4"])
    # Hydra's append bypasses the schema, and OmegaConf.to_object would drop the key: to_train_config rejects it.
    with pytest.raises(ValueError, match=r"parallel.backend has unknown keys \['cp_size'\]; known: "
                                         r"\['fsdp_ignored_modules', 'name', 'reshard_after_forward'\]"):
        compose_config(["parallel=ep2", "+parallel.backend.cp_size=2"])
    with pytest.raises(ValueError, match=r"parallel.backend has unknown keys \['ep_size'\]"):
        compose_config(["parallel=ep2", "+parallel.backend.ep_size=2"])


@pytest.mark.parametrize("key", ["dp_size", "mp_shard_size", "backend.ep_dispatcher"])
def test_derived_and_copied_keys_are_gone(key):
    # dp = world / cp and mp_shard = world / mp_replicate are derived (dims.resolve_sizes), never set; the
    # dispatcher is the dispatcher group's.
    with pytest.raises(ConfigCompositionException, match=key.split(".")[-1]):
        compose_config(["parallel=ep2", f"parallel.{key}=4"])
    with pytest.raises(ValueError, match=rf"parallel(.backend)? has unknown keys \['{key.split('.')[-1]}'\]"):
        compose_config(["parallel=ep2", f"+parallel.{key}=4"])


def test_the_sizes_sit_together_at_the_top_of_parallel():
    fields = list(ParallelConfig.__dataclass_fields__)
    assert fields[:5] == ["name", "cp_size", "ep_size", "efsdp_size", "mp_replicate_size"]
    assert list(BackendConfig.__dataclass_fields__) == ["name", "reshard_after_forward", "fsdp_ignored_modules"]


@pytest.mark.parametrize("kwargs, world, error, pattern", [
    (dict(ep_size=3), 8, ValueError,
     r"parallel.ep_size=3 must divide dp=8 \(world 8 / cp 1\); fix: parallel.ep_size one of \[1, 2, 4, 8\]"),
    (dict(ep_size=16), 8, ValueError, r"parallel.ep_size=16 must divide dp=8"),
    (dict(ep_size=8), 8, ValueError, r"parallel.ep_size=8 must divide model.arch.num_experts=4 .*one of \[1, 2, 4\]"),
    (dict(ep_size=2, efsdp_size=3), 8, ValueError,
     r"parallel.efsdp_size=3 must divide dp/ep=4 \(dp 8 / ep 2\); fix: parallel.efsdp_size one of \[1, 2, 4\], or -1"),
    (dict(ep_size=2, efsdp_size=0), 8, ValueError, r"parallel.efsdp_size=0 must divide dp/ep=4"),
    (dict(cp_size=2), 8, ValueError, r"parallel.cp_size=2: checking context parallelism needs the model's head"),
    (dict(cp_size=3), 8, ValueError, r"parallel.cp_size=3 must divide the world size 8"),
    (dict(cp_mode="ring"), 8, ValueError, r"parallel.cp_mode='ring' must be one of ulysses"),
    (dict(mp_replicate_size=3), 8, ValueError, r"parallel.mp_replicate_size=3 must divide the world size 8"),
    (dict(name="megatron"), 8, ValueError, r"parallel.backend.name='megatron' is unknown; choose one of none, ddp"),
    (dict(activation_checkpoint="some"), 8, ValueError, r"parallel.activation_checkpoint='some' must be one of"),
    (dict(dist_timeout=0), 8, ValueError, r"parallel.dist_timeout=0 must be a positive"),
    (dict(), 1, ValueError, r"parallel.backend.name=fsdp2 needs more than one process \(WORLD_SIZE=1\)"),
    (dict(name="none"), 4, ValueError, r"parallel.backend.name=none runs one process but WORLD_SIZE=4"),
    (dict(name="ddp", ep_size=2), 8, ValueError, r"parallel.ep_size=2: parallel.backend.name=ddp replicates"),
    (dict(name="ddp", mp_replicate_size=2), 8, ValueError, r"parallel.mp_replicate_size=2: .*name=ddp"),
])
def test_bad_layouts_fail_naming_the_key_and_the_fix(kwargs, world, error, pattern):
    num_experts = 4 if kwargs.get("ep_size") == 8 else 8
    with pytest.raises(error, match=pattern):
        validate_parallel_config(_cfg(**kwargs), world, num_experts)


def test_derived_sizes_come_from_one_place():
    cfg = _cfg(ep_size=4, efsdp_size=2, mp_replicate_size=2)
    validate_parallel_config(cfg, 32, 128)
    sizes = resolve_sizes(cfg, 32)
    assert (sizes.dp, sizes.cp, sizes.ep, sizes.efsdp, sizes.edp) == (32, 1, 4, 2, 4)
    assert (sizes.mp_replicate, sizes.mp_shard) == (2, 16)
    assert resolve_sizes(replace(cfg, cp_size=2), 32).expert_mesh_shape == (2, 2, 4, 2)


def test_a_layout_for_more_processes_than_started_is_one_line_before_any_mesh(tiny_run_config):
    """parallel=ep2 in one process (no torchrun; before: a ZeroDivisionError while building the meshes), and ep4 on
    2 ranks (under torchrun with too few: each rank's 80-line traceback): the sizes are checked first."""
    with pytest.raises(ValueError, match=r"parallel.ep_size=2 must divide dp=1 .*this is one process \(WORLD_SIZE=1\): "
                                         r"start several with launch.nproc_per_node=N"):
        train.run(tiny_run_config("parallel=ep2"))
    with pytest.raises(ValueError, match=r"parallel.ep_size=4 must divide dp=2 \(world 2 / cp 1\); fix: parallel."
                                         r"ep_size one of \[1, 2\]$"):
        build_parallel_dims(compose_config(["parallel=ep4"]).parallel, 2, 0, "cpu")  # no process group: not reached
