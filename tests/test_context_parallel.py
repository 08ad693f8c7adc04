"""Ulysses context parallelism and packed documents.

- Every CP preset that fits 8 gloo ranks trains both families through ``train.run`` like one process: the same
  loss and grad norm over 3 steps (fp32, rel 1e-4: the layouts differ only in summation order), on packed
  documents, so the CP runs mask documents across cp ranks exactly as the single process does; plus full and
  selective activation checkpointing around the all-to-alls; and one CP + EP layout on chats with only the
  assistant tokens trained, so dp ranks and cp shards hold different numbers of trained tokens.
- Packed documents give the logits of each document run as its own row, without CP and under cp2 / cp4 (cp4
  repeats the 2 kv heads and DeltaNet's 2 q/k heads), with the dense-mask reference and under cp4 with each
  document-attention kernel (FlexAttention's block mask and the varlen wrapper, built from the whole sequence's
  position ids after the all-to-all); Qwen3-MoE's packed rows equal transformers' packed sequences.
- The 16-rank cp2_ep4_efsdp2 meshes (a fake process group, no spawn), and the config checks.
All ranks' work is one spawn of 8.
"""

from __future__ import annotations

import dataclasses
import gc
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_gather_tensor

import train
from models import build_args, get_spec
from models.hf_io import export_hf
from models.layers import document_ids, known_documents
from parallelisms import (BackendConfig, ParallelConfig, build_parallel_dims, parallelize_qwen3_moe, resolve_sizes,
                          validate_parallel_config)
from tests.conftest import compose_config, trained_tokens_per_rank, write_chats
from tests.dist_utils import load_full_weights, run_distributed
from tests.test_attention import IMPLS as ATTENTION_KERNELS
from tests.test_attention import use_attention
from training.data.packing import context_shard
from training.data.tokenizer import QwenTokenizer

pytestmark = pytest.mark.torch_apis  # DTensor, FSDP2, context parallelism on gloo ranks

WORLD, STEPS, SEQ, GLOBAL_BATCH, EOS = 8, 3, 32, 8, 0
PRESETS = ["cp2", "cp4", "cp2_ep2_efsdp2", "cp2_ep2_edp2"]  # every CP preset that fits 8 ranks
# Activation checkpointing around the all-to-alls: recomputed (full; both mixers) and kept (selective). Qwen3.5 is
# left out of selective: it fails under fsdp2 without CP too (an FSDP record_function seen only in the recompute).
AC_VARIANTS = {("qwen3_5_moe", "cp4-full_ac"): ("cp4", "full"),
               ("qwen3_moe", "cp2_ep2_efsdp2-selective_ac"): ("cp2_ep2_efsdp2", "selective")}
CHATS = "cp2_ep2_efsdp2"  # the layout (dp 4, cp 2) that also trains Qwen3-MoE on masked chats
# Qwen3.5's MTP head trained on the packed documents under CP + EP + expert FSDP with full AC: the shift by one
# crosses the cp shards, the pairs that cross a document end are masked, its experts are sharded like the others.
MTP = ("cp2_ep2_efsdp2", "full")
MTP_WEIGHT = 0.3
TINY = {  # per family: the debug preset cut to the synthetic 256-token vocabulary
    "qwen3_moe": ["model=qwen3_moe_debug", "model.arch.vocab_size=256", "model.arch.hidden_size=32",
                  "model.arch.head_dim=8", "model.arch.moe_intermediate_size=16"],
    "qwen3_5_moe": ["model=qwen35_moe_debug", "model.arch.vocab_size=256", "model.arch.hidden_size=32",
                    "model.arch.moe_intermediate_size=16", "model.arch.shared_expert_intermediate_size=16"],
}
# Two packed rows of SEQ tokens: documents crossing the cp shard boundaries (8, 16, 24), and one whole row.
DOC_LENGTHS = [[5, 11, 3, 13], [SEQ]]


def write_documents(path: Path, num_tokens: int, seed: int = 0) -> None:
    """A token corpus of documents of 3..23 tokens, each ended by EOS: learnable runs of a fixed random pattern."""
    rng = np.random.default_rng(seed)
    pattern = rng.integers(1, 256, size=97)
    docs = []
    while sum(map(len, docs)) < num_tokens:
        docs.append(np.append(np.roll(pattern, -rng.integers(97))[:rng.integers(3, 24)], EOS))
    np.save(path, np.concatenate(docs)[:num_tokens].astype(np.int64))


def train_config(tmp_path: Path, family: str, parallel: str, *overrides: str, run: str | None = None,
                 chats: bool = False, mtp: bool = False):
    """3 steps from tmp_path/<family> on tmp_path/tokens.npy, a global batch of GLOBAL_BATCH, clipping active.
    chats: from tmp_path/<family>-chats (the tokenizer's vocabulary) on tmp_path/chats.jsonl, training only the
    assistant tokens. mtp: from tmp_path/<family>-mtp, training its MTP head too (MTP_WEIGHT)."""
    dp = 1 if parallel == "single" else WORLD // compose_config([f"parallel={parallel}"]).parallel.cp_size
    if chats:
        source = [f"model.arch.vocab_size={QwenTokenizer().vocab_size}", f"model.init_from={tmp_path / family}-chats",
                  "data=jsonl", f"data.path={tmp_path / 'chats.jsonl'}", "data.mask_non_assistant=true"]
    else:
        source = [f"model.init_from={tmp_path / family}{'-mtp' if mtp else ''}", "data=tokens",
                  f"data.path={tmp_path / 'tokens.npy'}", f"data.eos_id={EOS}"]
        source += [f"model.arch.mtp_loss_weight={MTP_WEIGHT}"] if mtp else []
    return compose_config([
        *TINY[family], *source, f"parallel={parallel}", f"data.seq_len={SEQ}",
        f"data.cache_dir={tmp_path / 'cache'}", f"train.output_dir={tmp_path / f'{family}-{run or parallel}'}",
        f"train.steps={STEPS}", f"train.local_batch_size={GLOBAL_BATCH // dp}", "train.save_final=false",
        "optim.warmup_steps=0", "optim.lr=1e-2", "optim.grad_clip=0.5", "logging.tensorboard=false",
        "train.device=cpu", "train.mixed_precision=fp32", *overrides])


def model_args(family: str):
    cfg = compose_config(TINY[family])
    return build_args(cfg.model.model_type, dict(cfg.model.arch))


def seeded_model(family: str, **arch) -> torch.nn.Module:
    torch.manual_seed(0)
    model = get_spec(family).model_cls(dataclasses.replace(model_args(family), **arch))
    model.init_weights()
    return model


def packed_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and document-restarting position ids [2, SEQ] of DOC_LENGTHS."""
    input_ids_BT = torch.randint(1, 256, (len(DOC_LENGTHS), SEQ), generator=torch.Generator().manual_seed(1))
    position_ids_BT = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOC_LENGTHS])
    return input_ids_BT, position_ids_BT


def separate_rows_logits(model: torch.nn.Module, input_ids_BT: torch.Tensor) -> torch.Tensor:
    """Logits of every document of DOC_LENGTHS run as a row of its own, put back in packed order."""
    rows = []
    for b, lengths in enumerate(DOC_LENGTHS):
        starts = np.cumsum([0, *lengths])
        rows.append(torch.cat([model(input_ids_BT[b:b + 1, s:e]).logits for s, e in zip(starts, starts[1:])], dim=1))
    return torch.cat(rows)


def cp_logits(family: str, preset: str, args, weights: dict, dims, parallel: ParallelConfig) -> dict:
    """Logits of the packed batch under ``preset`` (``parallel`` its config, ``dims`` its meshes), each rank running
    its cp shard, gathered over cp: ``family-preset`` with the reference in every document-attention slot, and under
    cp4 then, on the same model, ``family-cp4-<name>`` with each kernel of ATTENTION_KERNELS in every slot. The caller
    composes the configs (Hydra's ~0.5 s of CPU a composition, paid by 8 ranks on 2 cores) and builds each preset's
    meshes once for both families."""
    spec = get_spec(family)
    with torch.device("meta"):
        model = spec.model_cls(args)
    model = parallelize_qwen3_moe(model, spec, dims, parallel, torch.float32, torch.float32)
    model.to_empty(device="cpu")
    load_full_weights(model, weights)
    input_ids_BT, position_ids_BT = packed_batch()
    shard = context_shard({"input_ids": input_ids_BT, "position_ids": position_ids_BT}, dims.cp_rank, dims.cp)
    logits = {}
    for name in [None, *(ATTENTION_KERNELS if preset == "cp4" else [])]:
        if name is not None:
            use_attention(model, ATTENTION_KERNELS[name]())
        with torch.no_grad():
            logits_BtV = model(shard["input_ids"], shard["position_ids"]).logits
        key = f"{family}-{preset}" if name is None else f"{family}-{preset}-{name}"
        logits[key] = all_gather_tensor(logits_BtV, gather_dim=1, group=dims.mesh("cp").get_group()).clone()
    return logits


def worker(rank: int, world_size: int, cfgs: dict, weights: dict, layouts: dict, args: dict) -> tuple[dict, dict]:
    gc.freeze()  # what the rank inherited (the fork server's imports) is kept out of every GC pass: less CPU
    histories = {name: train.run(cfg) for name, cfg in cfgs.items()}
    logits = {}
    for preset, parallel in layouts.items():
        dims = build_parallel_dims(parallel, world_size, rank, "cpu")
        for family in TINY:
            logits |= cp_logits(family, preset, args[family], weights[family], dims, parallel)
    return histories, logits


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("context_parallel")
    write_documents(tmp_path / "tokens.npy", 4096)
    weights = {}
    for family in TINY:  # one seeded checkpoint per family that every layout loads
        model = seeded_model(family)
        export_hf(model, family, tmp_path / family)
        weights[family] = {k: v.clone() for k, v in model.state_dict().items()}
    export_hf(seeded_model("qwen3_5_moe", mtp_loss_weight=MTP_WEIGHT), "qwen3_5_moe", tmp_path / "qwen3_5_moe-mtp")
    write_chats(tmp_path / "chats.jsonl")
    export_hf(seeded_model("qwen3_moe", vocab_size=QwenTokenizer().vocab_size), "qwen3_moe",
              tmp_path / "qwen3_moe-chats")
    reference = {family: train.run(train_config(tmp_path, family, "single")) for family in TINY}
    reference["qwen3_moe-chats"] = train.run(train_config(tmp_path, "qwen3_moe", "single", run="single-chats",
                                                          chats=True))
    reference["qwen3_5_moe-mtp"] = train.run(train_config(tmp_path, "qwen3_5_moe", "single", run="single-mtp",
                                                          mtp=True))
    cfgs = {f"{family}-{preset}": train_config(tmp_path, family, preset) for family in TINY for preset in PRESETS}
    cfgs.update({f"{family}-{name}": train_config(tmp_path, family, preset, f"parallel.activation_checkpoint={mode}",
                                                  run=name)
                 for (family, name), (preset, mode) in AC_VARIANTS.items()})
    cfgs[f"qwen3_moe-{CHATS}-chats"] = train_config(tmp_path, "qwen3_moe", CHATS, run=f"{CHATS}-chats", chats=True)
    cfgs["qwen3_5_moe-mtp"] = train_config(tmp_path, "qwen3_5_moe", MTP[0], f"parallel.activation_checkpoint={MTP[1]}",
                                           run="cp-mtp", mtp=True)
    layouts = {preset: compose_config([f"parallel={preset}"]).parallel for preset in ("cp2", "cp4")}
    args = {family: model_args(family) for family in TINY}
    histories, logits = run_distributed(worker, WORLD, cfgs, weights, layouts, args, timeout_s=600)
    return reference, histories, cfgs, logits, weights


@pytest.mark.parametrize("family, preset", [(f, p) for f in TINY for p in PRESETS] + list(AC_VARIANTS))
def test_cp_preset_trains_like_one_process(runs, family, preset):
    reference, histories, *_ = runs
    got, want = histories[f"{family}-{preset}"], reference[family]
    assert [m["step"] for m in got] == [m["step"] for m in want] == list(range(1, STEPS + 1))
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-4), f"step {g['step']}"
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-4), f"step {g['step']}"
    assert want[0]["grad_norm"] > 0.5  # max_norm 0.5 really clipped


def test_cp_on_masked_chats_with_unequal_token_counts_trains_like_one_process(runs):
    """cp2_ep2_efsdp2 on chats with only assistant tokens trained against the single-process run: every rank's
    loss share is normalised by the global count of trained tokens, not by dp (x cp) x its own count."""
    reference, histories, cfgs, *_ = runs
    name = f"qwen3_moe-{CHATS}-chats"
    sizes = resolve_sizes(cfgs[name].parallel, WORLD)
    counts = trained_tokens_per_rank(cfgs[name], sizes.dp, sizes.cp)
    # The dp ranks, and the cp shards of a dp rank, really train different numbers of tokens.
    assert len({sum(c) for c in counts}) > 1 and any(len(set(c)) > 1 for c in counts), counts
    got, want = histories[name], reference["qwen3_moe-chats"]
    assert [m["step"] for m in got] == [m["step"] for m in want] == list(range(1, STEPS + 1))
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-4), f"step {g['step']}"
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-4), f"step {g['step']}"
    assert want[0]["grad_norm"] > 0.5  # max_norm 0.5 really clipped


def test_mtp_head_under_cp_ep_and_ac_trains_like_one_process(runs):
    reference, histories, *_ = runs
    got, want = histories["qwen3_5_moe-mtp"], reference["qwen3_5_moe-mtp"]
    assert [m["step"] for m in got] == [m["step"] for m in want] == list(range(1, STEPS + 1))
    for g, w in zip(got, want):
        for key in ("loss", "mtp_loss", "aux_loss", "grad_norm"):
            assert g[key] == pytest.approx(w[key], rel=1e-4), f"step {g['step']}: {key}"
    # The head trained: its loss is not the main loss, and the run is not the one without the head.
    assert want[0]["mtp_loss"] != pytest.approx(want[0]["loss"], rel=1e-3)
    assert want[-1]["loss"] != pytest.approx(reference["qwen3_5_moe"][-1]["loss"], rel=1e-4)


def assert_documents_separate(model: torch.nn.Module, packed_logits: torch.Tensor) -> None:
    input_ids_BT, _ = packed_batch()
    with torch.no_grad():
        want = separate_rows_logits(model, input_ids_BT)
        unmasked = model(input_ids_BT).logits
    # fp32 reordering only (masked conv taps and per-document delta rule against F.conv1d and one long row).
    torch.testing.assert_close(packed_logits, want, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(unmasked, want, rtol=1e-4, atol=1e-5)  # the masking is what made them equal


@pytest.mark.parametrize("family", list(TINY))
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_packed_documents_equal_separate_rows(family, mode):
    """eval: evaluation without autograd, where DeltaNet runs its token-by-token rule on rows of <= 64 tokens: it
    too must restart its state at every document."""
    model = seeded_model(family, initializer_range=0.1)  # far from uniform attention, so a leak would show
    model.train(mode == "train")
    with torch.no_grad():
        packed = model(*packed_batch()).logits
    assert_documents_separate(model, packed)


@pytest.mark.parametrize("family", list(TINY))
@pytest.mark.parametrize("preset", ["cp2", "cp4", *(f"cp4-{name}" for name in ATTENTION_KERNELS)])
def test_packed_documents_equal_separate_rows_under_cp(runs, family, preset):
    *_, logits, weights = runs
    model = get_spec(family).model_cls(model_args(family))
    model.load_state_dict(weights[family])
    assert_documents_separate(model, logits[f"{family}-{preset}"])


def test_packed_rows_equal_transformers_packed_sequences():
    """transformers detects packed sequences from position ids (with no mask and no cache) by the same rule."""
    import transformers  # here: a rank that imports this module for its worker would spend ~0.8 s of CPU on it

    ours = seeded_model("qwen3_moe", initializer_range=0.1)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**vars(ours.args))).float()
    hf.load_state_dict(ours.state_dict(), strict=True)
    input_ids_BT, position_ids_BT = packed_batch()
    with torch.no_grad():
        got = ours(input_ids_BT, position_ids_BT).logits
        want = hf(input_ids=input_ids_BT, position_ids=position_ids_BT, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)  # fp32 round-off of two orderings, as the parity tests


def test_document_ids_follow_transformers_rule():
    position_ids_BT = torch.tensor([[0, 1, 2, 0, 1, 0, 0], [4, 5, 6, 7, 8, 9, 10]])
    assert document_ids(position_ids_BT).tolist() == [[0, 0, 0, 1, 1, 2, 3], [0, 0, 0, 0, 0, 0, 0]]
    assert document_ids(torch.arange(7).expand(2, 7) + 3) is None  # unpacked rows keep the causal kernel
    assert document_ids(position_ids_BT.expand(3, 2, 7)) is None  # multimodal streams: one document per row
    # The trainer's answer from the host copy, which spares the forward its sync, gives the same ids or None.
    assert document_ids(position_ids_BT, packed=True).tolist() == document_ids(position_ids_BT).tolist()
    assert document_ids(position_ids_BT, packed=False) is None


def test_a_model_told_whether_rows_are_packed_computes_as_one_that_finds_out():
    model = seeded_model("qwen3_moe", initializer_range=0.1).eval()
    input_ids_BT, position_ids_BT = packed_batch()
    with torch.no_grad():
        found = model(input_ids_BT, position_ids_BT).logits
        told = model(input_ids_BT, position_ids_BT, packed=True).logits
        hint = known_documents(position_ids_BT, torch.device("cpu"))
        known = model(input_ids_BT, position_ids_BT, packed=hint).logits
        unpacked = model(input_ids_BT, position_ids_BT, packed=False).logits  # what packed=False would misread
    assert torch.equal(found, told) and torch.equal(found, known) and not torch.allclose(found, unpacked)


# ---------------------------------------------------------------------------------------------- without a spawn

def test_seeds_16_rank_layout_meshes():
    """cp2_ep4_efsdp2 on 16 ranks (fake process group): cp ranks are neighbours sharing a batch slice; each
    ep group holds one cp coordinate; experts are sharded over efsdp and replicated over expert_cp."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from parallelisms.dims import _build_meshes

    cfg = compose_config(["parallel=cp2_ep4_efsdp2"]).parallel
    for arch in ({"num_attention_heads": 32, "num_key_value_heads": 4},  # Qwen3-30B-A3B
                 {"num_attention_heads": 16, "num_key_value_heads": 2,  # Qwen3.5-35B-A3B
                  "linear_num_value_heads": 32, "linear_num_key_heads": 16}):
        validate_parallel_config(cfg, 16, 128, heads=_heads(arch), seq_len=4096)
    sizes = resolve_sizes(cfg, 16)
    assert (sizes.dp, sizes.cp, sizes.ep, sizes.efsdp, sizes.edp) == (8, 2, 4, 2, 1)
    assert sizes.expert_mesh_shape == (1, 2, 4, 2)
    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=16)
    try:
        meshes = _build_meshes(sizes, "cpu")
        groups = {name: meshes[name].mesh.tolist() for name in ("cp", "ep", "efsdp", "edp_cp", "expert_fsdp")}
    finally:
        dist.destroy_process_group()
    assert groups == {"cp": [4, 5], "ep": [1, 3, 5, 7], "efsdp": [5, 13], "edp_cp": [4, 5],
                      "expert_fsdp": [[4, 12], [5, 13]]}


def _heads(arch: dict | None) -> list | None:
    """The head counts Qwen3.5's spec declares for the checks (the mixers ``arch`` has heads for)."""
    from models import get_spec

    pairs = get_spec("qwen3_5_moe").cp_heads
    return None if arch is None else [(s, arch[s], t, arch[t]) for s, t in pairs if s in arch]


QWEN3_HEADS = {"num_attention_heads": 4, "num_key_value_heads": 2}
QWEN35_HEADS = {**QWEN3_HEADS, "linear_num_value_heads": 8, "linear_num_key_heads": 2}


@pytest.mark.parametrize("cp, arch, seq_len, pattern", [
    (4, {"num_attention_heads": 6, "num_key_value_heads": 2}, 64,
     r"model.arch.num_attention_heads=6 must be divisible by parallel.cp_size=4 .*fix: parallel.cp_size one of "
     r"\[1, 2\]"),
    (4, {"num_attention_heads": 12, "num_key_value_heads": 3}, 64,
     r"model.arch.num_key_value_heads=3 and parallel.cp_size=4: one must divide the other"),
    (4, {**QWEN35_HEADS, "linear_num_value_heads": 12, "linear_num_key_heads": 3}, 64,
     r"model.arch.linear_num_key_heads=3 and parallel.cp_size=4: one must divide the other"),
    (4, {**QWEN35_HEADS, "linear_num_value_heads": 6, "linear_num_key_heads": 2}, 64,
     r"model.arch.linear_num_value_heads=6 must be divisible by parallel.cp_size=4"),
    (2, QWEN3_HEADS, 33, r"data.seq_len=33 must be divisible by parallel.cp_size=2 .*fix: parallel.cp_size one of \[1\]"),
    (3, QWEN3_HEADS, 60, r"parallel.cp_size=3 must divide the world size 8"),
    (2, None, 64, r"parallel.cp_size=2: checking context parallelism needs the model's head counts"),
])
def test_bad_cp_layouts_fail_naming_the_key_and_the_fix(cp, arch, seq_len, pattern):
    with pytest.raises(ValueError, match=pattern):
        validate_parallel_config(ParallelConfig(cp_size=cp, backend=BackendConfig()), 8, 8, heads=_heads(arch),
                                 seq_len=seq_len)


@pytest.mark.parametrize("cp, arch", [(2, QWEN3_HEADS), (4, QWEN3_HEADS), (4, QWEN35_HEADS), (8, {
    "num_attention_heads": 8, "num_key_value_heads": 1})])
def test_cp_up_to_the_heads_validates(cp, arch):
    validate_parallel_config(ParallelConfig(cp_size=cp, backend=BackendConfig()), 8, 8, heads=_heads(arch), seq_len=64)
