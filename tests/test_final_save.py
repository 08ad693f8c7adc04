"""The final weights and the in-training Hugging Face export, streamed a tensor at a time.

The streaming safetensors writer against safetensors' own ``save_file`` (the same bytes in its order, every
dtype it knows, 0-dim and empty tensors); a 4-rank EP x FSDP model (gloo) whose ``model.safetensors`` and
``hf/`` equal the single-process ones byte for byte; a writer that fails (before or in the middle of a file)
without hanging the other ranks; and the host memory of the save: every rank's peak RSS grows by a few times
the largest tensor (the all-gather's buffers), while the old whole-model gather (``full_state_dict`` on every
rank) grows each by the whole model.
"""

from __future__ import annotations

import json
import re
import struct
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from core.safetensors_stream import (_DTYPES, TensorLayout, header, layout_of, save_file_order, stream_gathered,
                                     write_safetensors)
from tests.dist_utils import debug_model_args, load_full_weights, run_distributed, seeded_weights

pytestmark = pytest.mark.torch_apis  # gathering DTensor shards

SMALL_SHARD = 50_000  # bytes: the debug model's export spans several shards, some boundaries inside a tensor


def _tensors() -> dict[str, torch.Tensor]:
    """One tensor of every dtype the writer knows (so every rank of save_file's order), plus edge cases."""
    g = torch.Generator().manual_seed(0)
    floats = torch.randn(24, generator=g)
    out = {f"t.{str(dtype).removeprefix('torch.')}": floats.to(dtype).reshape(2, 3, 4) for dtype in (
        torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2,
        torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu)}
    ints = torch.randint(0, 100, (5,), generator=g)
    out |= {f"t.{str(dtype).removeprefix('torch.')}": ints.to(dtype) for dtype in (
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.uint64, torch.uint32, torch.uint16)}
    out |= {"bool": ints > 50, "scalar": torch.tensor(3.5), "scalar.bf16": torch.tensor(-2.0, dtype=torch.bfloat16),
            "empty": torch.empty(0, 7), "empty.i8": torch.empty(3, 0, dtype=torch.int8),
            "ünïcode.name": floats[:3].clone(), "a.same.dtype.sorted.by.name": floats[3:6].clone()}
    return out


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                      b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("metadata", [None, {"format": "pt"}])
def test_streamed_file_is_the_bytes_save_file_writes(tmp_path: Path, metadata) -> None:
    tensors = _tensors()
    save_file(tensors, tmp_path / "reference.safetensors", metadata=metadata)
    layouts = save_file_order({name: layout_of(t) for name, t in tensors.items()})
    assert {layout.dtype for layout in layouts.values()} == set(_DTYPES)  # every dtype the writer knows
    write_safetensors(tmp_path / "streamed.safetensors", layouts, (tensors[n] for n in layouts), metadata=metadata)
    assert (tmp_path / "streamed.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()
    loaded = load_file(tmp_path / "streamed.safetensors")
    assert loaded.keys() == tensors.keys() and all(_bytes_equal(loaded[n], t) for n, t in tensors.items())
    with safe_open(tmp_path / "streamed.safetensors", framework="pt") as f:
        assert f.metadata() == metadata
        assert _bytes_equal(f.get_slice("t.bfloat16")[1:, :2], tensors["t.bfloat16"][1:, :2])


def test_any_order_of_one_dtype_and_any_strides_load_equal(tmp_path: Path) -> None:
    """The HF export writes in the order it gathers (not by name) and slices of fused tensors; readers sort by
    offset, so the file loads equal; a header entry per tensor, offsets back to back in the order given."""
    full = torch.randn(4, 6, 5)
    tensors = {"z": full[0, :3], "a": full[1].t(), "m": full[2, ::2], "b": torch.tensor(1.0), "e": torch.empty(0)}
    layouts = {name: layout_of(t) for name, t in tensors.items()}
    write_safetensors(tmp_path / "x.safetensors", layouts, iter(tensors.values()), metadata={"format": "pt"})
    loaded = load_file(tmp_path / "x.safetensors")
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[n], t) for n, t in tensors.items())
    data = (tmp_path / "x.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    entries = json.loads(data[8:8 + length])
    assert length % 8 == 0 and list(entries) == ["__metadata__", *tensors]
    ends = [0] + [entries[n]["data_offsets"][1] for n in tensors]
    assert [entries[n]["data_offsets"][0] for n in tensors] == ends[:-1] and len(data) == 8 + length + ends[-1]


def test_writer_refuses_what_it_cannot_write_right(tmp_path: Path) -> None:
    f32, bf16 = TensorLayout((2,), torch.float32), TensorLayout((2,), torch.bfloat16)
    with pytest.raises(ValueError, match="item size 4 after 2"):  # misaligned: 2-byte data before 4-byte data
        header({"a": bf16, "b": f32})
    with pytest.raises(ValueError, match=r"b is \(3,\) torch.float32, its header says \(2,\)"):
        write_safetensors(tmp_path / "x", {"a": f32, "b": f32}, [torch.zeros(2), torch.zeros(3)])
    with pytest.raises(ValueError, match="no tensor for b"):
        write_safetensors(tmp_path / "x", {"a": f32, "b": f32}, [torch.zeros(2)])
    with pytest.raises(ValueError, match="complex64 is not written"):
        save_file_order({"c": TensorLayout((1,), torch.complex64)})


def test_tied_final_weights_omit_lm_head_and_equal_save_file(tmp_path: Path) -> None:
    from models import get_spec
    from training.checkpoint import full_state_dict, save_model_weights

    args = debug_model_args(tie_word_embeddings=True)
    model = get_spec("qwen3_moe").model_cls(args)
    model.load_state_dict(seeded_weights(args))
    save_model_weights(model, tmp_path / "model.safetensors", is_writer=True)
    save_file(full_state_dict(model), tmp_path / "reference.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "model.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left


# ------------------------------------------------------------------------------------------ 4 gloo ranks
# The memory case: 8 layers of 16 experts (~104 MiB fp32), the largest tensor one layer's gate_up_proj (8 MiB).
MEMORY_ARCH = dict(vocab_size=2048, hidden_size=256, num_hidden_layers=8, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64, num_experts=16, moe_intermediate_size=256)
LARGEST_MIB = 16 * 2 * 256 * 256 * 4 / 2**20


def _sharded_model(rank: int, world_size: int, **arch):
    import models
    from parallelisms import BackendConfig, ParallelConfig, build_parallel_dims, parallelize_qwen3_moe

    cfg = ParallelConfig(name="ep2", ep_size=2, backend=BackendConfig())  # ep 2 x expert FSDP 2; the rest FSDP 4
    dims = build_parallel_dims(cfg, world_size, rank, "cpu")
    with torch.device("meta"):
        model = models.get_spec("qwen3_moe").model_cls(debug_model_args(**arch))
    model = parallelize_qwen3_moe(model, models.get_spec("qwen3_moe"), dims, cfg, torch.float32, torch.float32)
    model.to_empty(device="cpu")
    return model


def _peak_growth_mib(fn) -> float:
    """VmHWM growth while fn runs (Linux: writing 5 to clear_refs resets the peak to the current RSS)."""
    def status_mib(field: str) -> float:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status_mib("VmRSS")
    fn()
    return status_mib("VmHWM") - before


def _worker(rank: int, world_size: int, out: str) -> tuple[list[str], list[list[float]] | None]:
    from models.hf_io import INDEX, export_hf
    from training.checkpoint import full_state_dict, save_model_weights

    out_dir = Path(out)
    model = _sharded_model(rank, world_size)
    load_full_weights(model, seeded_weights(debug_model_args()))
    save_model_weights(model, out_dir / "model.safetensors", is_writer=rank == 0)

    calls = []

    def extra_files(tmp: Path) -> None:  # the weights and config.json are there; tokenizer files may join them
        calls.append(str(tmp))
        shards = set(json.loads((tmp / INDEX).read_text())["weight_map"].values())
        assert {p.name for p in tmp.iterdir()} == shards | {INDEX, "config.json"}
        config = json.loads((tmp / "config.json").read_text())
        (tmp / "config.json").write_text(json.dumps({**config, "eos_token_id": 7}))
        (tmp / "tokenizer.json").write_text("{}")

    export_hf(model, "qwen3_moe", out_dir / "hf", max_shard_bytes=SMALL_SHARD, extra_files=extra_files)

    # A writer that fails before writing a byte: the other ranks still finish the gathers, nobody hangs.
    try:
        save_model_weights(model, out_dir / "no-such-dir" / "model.safetensors", is_writer=rank == 0)
        assert rank != 0, "rank 0 cannot write there"
    except FileNotFoundError:
        assert rank == 0

    def disk_full_after_two(host: Iterator[torch.Tensor]) -> None:  # and one that fails mid-file
        next(host), next(host)
        raise OSError("disk full")

    params = dict(model.named_parameters())
    try:
        stream_gathered(params, sorted(params), disk_full_after_two if rank == 0 else None)
        assert rank != 0
    except OSError:
        assert rank == 0
    dist.barrier()
    if not Path("/proc/self/clear_refs").exists():
        return calls, None

    model = _sharded_model(rank, world_size, **MEMORY_ARCH)
    with torch.no_grad():
        for param in model.parameters():
            param.to_local().normal_()  # values do not matter here; the pages must be resident
    (out_dir / "memory").mkdir(exist_ok=True)
    dist.barrier()
    growth = [_peak_growth_mib(lambda: save_model_weights(model, out_dir / "memory" / "model.safetensors",
                                                          is_writer=rank == 0)),
              _peak_growth_mib(lambda: full_state_dict(model))]  # the old way: shows that RSS sees a whole model
    everyone = [None] * world_size
    dist.all_gather_object(everyone, growth)
    return calls, everyone


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> tuple[Path, list[str], list[list[float]] | None]:
    tmp_path = tmp_path_factory.mktemp("final_save")
    (tmp_path / "ranks").mkdir()
    with pytest.MonkeyPatch.context() as patch:
        # Every large allocation its own mapping, returned on free: RSS then counts live tensors, not freed memory
        # that glibc keeps (its default threshold rises to the size of the largest block freed so far).
        patch.setenv("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
        calls, growth = run_distributed(_worker, 4, str(tmp_path / "ranks"), fork_server=False)  # a fresh glibc
    return tmp_path, calls, growth


def test_sharded_model_saves_and_exports_what_one_process_does(four_ranks) -> None:
    from models import get_spec
    from models.hf_io import INDEX, export_state_dict_hf
    from training.checkpoint import save_model_weights

    tmp_path, calls, _ = four_ranks
    args = debug_model_args()
    weights = seeded_weights(args)
    model = get_spec("qwen3_moe").model_cls(args)
    model.load_state_dict(weights)
    (tmp_path / "one").mkdir()
    save_model_weights(model, tmp_path / "one" / "model.safetensors", is_writer=True)
    save_file(weights, tmp_path / "reference.safetensors", metadata={"format": "pt"})
    streamed = (tmp_path / "ranks" / "model.safetensors").read_bytes()
    assert streamed == (tmp_path / "one" / "model.safetensors").read_bytes()
    assert streamed == (tmp_path / "reference.safetensors").read_bytes()
    assert not [p for p in (tmp_path / "ranks").iterdir() if p.name.startswith(".")]  # no temporary left

    export_state_dict_hf(weights, "qwen3_moe", args, tmp_path / "hf", max_shard_bytes=SMALL_SHARD)
    ranks, one = tmp_path / "ranks" / "hf", tmp_path / "hf"
    files = sorted(p.name for p in one.iterdir())
    assert sorted(p.name for p in ranks.iterdir()) == sorted(files + ["tokenizer.json"])
    weight_map = json.loads((one / INDEX).read_text())["weight_map"]
    assert len(weight_map) == 2 * (3 * 8 + 9) + 3  # per expert: gate, up, down; 9 more per layer; 3 outside
    files_of_fused = defaultdict(set)
    for name, file in weight_map.items():
        files_of_fused[re.sub(r"experts\.\d+\.(gate|up)_proj", "experts.gate_up_proj", name)].add(file)
    assert any(len(f) > 1 for f in files_of_fused.values())  # a fused tensor written across a shard boundary
    assert len(files) > 4 and (ranks / INDEX).read_text() == (one / INDEX).read_text()
    for name in files:
        if name.endswith(".safetensors"):
            assert (ranks / name).read_bytes() == (one / name).read_bytes(), name
    assert json.loads((ranks / "config.json").read_text()) == {**json.loads((one / "config.json").read_text()),
                                                                "eos_token_id": 7}
    assert len(calls) == 1 and Path(calls[0]).parent == ranks.parent and Path(calls[0]).name.startswith(".hf.tmp-")


def test_no_rank_holds_the_model_while_saving(four_ranks) -> None:
    """Peak RSS growth per rank during the save: the old whole-model gather grows every rank by the model; the
    streamed save by the all-gather's transient buffers of one tensor (gloo on CPU: ~2.6 x the largest; the
    writer's host copy is the gathered tensor itself on CPU)."""
    from models import get_spec

    _, _, growth = four_ranks
    if growth is None:
        pytest.skip("peak RSS reset needs Linux's /proc/self/clear_refs")
    with torch.device("meta"):
        model = get_spec("qwen3_moe").model_cls(debug_model_args(**MEMORY_ARCH))
    model_mib = sum(p.numel() * 4 for p in model.parameters()) / 2**20
    streamed, old = zip(*growth)
    assert all(g > 0.9 * model_mib for g in old), (old, model_mib)
    assert all(g < 4 * LARGEST_MIB < 0.35 * model_mib for g in streamed), (streamed, model_mib)
