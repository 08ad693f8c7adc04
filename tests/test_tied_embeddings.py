"""model.arch.tie_word_embeddings=true in both families: the LM head is the embedding after materialisation and
training, in the checkpoint, after a resume, in the final weights and in the HF export, whose transformers model
(tied) gives our trained model's loss and gradient; under FSDP2 (the two share one unit) and DDP a tied run trains
as one process does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

import train
from models import get_spec
from tests.conftest import compose_config, our_loss_like_transformers, write_tokens
from tests.dist_utils import assert_same_curve, run_distributed
from training.checkpoint import load_checkpoint, read_train_state

TINY = {  # per family: the debug preset cut to the synthetic 256-token vocabulary, tied
    "qwen3_moe": ["model=qwen3_moe_debug", "model.arch.vocab_size=256", "model.arch.hidden_size=32",
                  "model.arch.head_dim=8", "model.arch.moe_intermediate_size=16"],
    "qwen3_5_moe": ["model=qwen35_moe_debug", "model.arch.vocab_size=256", "model.arch.hidden_size=32",
                    "model.arch.moe_intermediate_size=16", "model.arch.shared_expert_intermediate_size=16"],
}


def config(tmp_path: Path, family: str, run: str, *overrides: str):
    return compose_config([
        *TINY[family], "model.arch.tie_word_embeddings=true", "model.tokenizer=none", "data=tokens",
        f"data.path={tmp_path / 'tokens.npy'}", "data.seq_len=16", f"data.cache_dir={tmp_path / 'cache'}",
        f"train.output_dir={tmp_path / run}", "train.local_batch_size=4", "optim.warmup_steps=0", "optim.lr=1e-2",
        "logging.tensorboard=false", "train.device=cpu", "train.mixed_precision=fp32", *overrides])


def recording(built: list[torch.nn.Module]):
    """train.build_model, appending each model it builds to ``built``."""
    build = train.build_model

    def record(*args, **kwargs):
        out = build(*args, **kwargs)
        built.append(out[0])
        return out

    return record


@pytest.mark.parametrize("family", list(TINY))
def test_a_tied_run_keeps_its_head_the_embedding_and_exports_transformers_tied_model(family, tmp_path, monkeypatch):
    write_tokens(tmp_path / "tokens.npy", 4096)
    built: list[torch.nn.Module] = []
    monkeypatch.setattr(train, "build_model", recording(built))
    history = train.run(config(tmp_path, family, "run", "train.steps=3", "checkpoint.interval=2",
                               "checkpoint.export_hf_at_end=true"))
    model = built[0].eval()
    embedding = model.model.embed_tokens.weight
    tied = model.lm_head.weight is embedding  # one parameter: one gradient, one AdamW state
    assert tied, "the LM head trained as a parameter of its own"
    fresh = get_spec(family).model_cls(model.args)
    fresh.init_weights()
    assert not torch.equal(fresh.model.embed_tokens.weight, embedding)  # it trained

    run = tmp_path / "run"
    final = load_file(run / "model.safetensors")
    assert "lm_head.weight" not in final and torch.equal(final["model.embed_tokens.weight"], embedding)
    # The checkpoint of the last step loads into a fresh tied model as the trained one.
    fresh.to_empty(device="cpu")
    last = run / "checkpoints" / "step_00000003"
    load_checkpoint(last, fresh, None, read_train_state(last)["files"])
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight and torch.equal(fresh.lm_head.weight, embedding)

    # A resume from step 2 trains step 3 as the uninterrupted run did, still tied.
    resumed = train.run(config(tmp_path, family, "resumed", "train.steps=3",
                               f"train.resume={run / 'checkpoints' / 'step_00000002'}"))
    assert [m["step"] for m in resumed] == [3] and resumed[0]["loss"] == pytest.approx(history[-1]["loss"], rel=1e-6)
    assert built[1].lm_head.weight is built[1].model.embed_tokens.weight
    torch.testing.assert_close(built[1].model.embed_tokens.weight, embedding, rtol=1e-6, atol=1e-7)

    # The export is transformers' tied model: its loss and its embedding's gradient (both uses) are ours.
    hf = transformers.AutoModelForCausalLM.from_pretrained(run / "hf", dtype=torch.float32,
                                                           output_router_logits=True).eval()
    assert hf.config.tie_word_embeddings and hf.lm_head.weight is hf.get_input_embeddings().weight
    ids_BT = torch.randint(0, model.args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    loss, _ = our_loss_like_transformers(model, ids_BT, model.args.num_experts, model.args.router_aux_loss_coef)
    loss.backward()
    reference = hf(input_ids=ids_BT, labels=ids_BT)
    reference.loss.backward()
    torch.testing.assert_close(loss, reference.loss, rtol=0, atol=1e-5)
    torch.testing.assert_close(embedding.grad, hf.get_input_embeddings().weight.grad, rtol=1e-4, atol=1e-6)


def _layouts_worker(rank: int, world_size: int, cfgs: dict) -> dict:
    """Each run's metrics, and whether its model's head was its embedding after training (rank 0's)."""
    built: list[torch.nn.Module] = []
    train.build_model = recording(built)  # this forked rank's own train module
    return {name: (train.run(cfg), built[-1].lm_head.weight is built[-1].model.embed_tokens.weight)
            for name, cfg in cfgs.items()}


def test_fsdp2_and_ddp_keep_the_tie_and_train_as_one_process(tmp_path):
    """Two gloo ranks under parallel=fsdp2 (the tied embedding and head are one FSDP unit) and ddp: each trains as
    one process does, tied; fsdp2's checkpoint resumes in one process, and its final weights are one process's."""
    write_tokens(tmp_path / "tokens.npy", 4096)
    reference = {family: train.run(config(tmp_path, family, f"single-{family}", "train.steps=3")) for family in TINY}
    two_ranks = ["train.steps=3", "train.local_batch_size=2"]
    layouts = {(family, "fsdp2"): config(tmp_path, family, f"fsdp2-{family}", *two_ranks, "checkpoint.interval=2",
                                         "parallel=fsdp2") for family in TINY}
    layouts["qwen3_moe", "ddp"] = config(tmp_path, "qwen3_moe", "ddp", *two_ranks, "parallel=ddp")
    results = run_distributed(_layouts_worker, 2, layouts)
    for (family, layout), (history, tied) in results.items():
        assert tied, layout
        assert_same_curve(history, reference[family], steps=[1, 2, 3])
    for family in TINY:
        # Its checkpoint resumes in one process, tied, as the one-process run trained on.
        resumed = train.run(config(tmp_path, family, f"resumed-{family}", "train.steps=3",
                                   f"train.resume={tmp_path / f'fsdp2-{family}' / 'checkpoints' / 'step_00000002'}"))
        assert_same_curve(resumed, reference[family], steps=[3])
        final, want = (load_file(tmp_path / f"{run}-{family}" / "model.safetensors") for run in ("fsdp2", "single"))
        assert "lm_head.weight" not in final and final.keys() == want.keys()
        for name, tensor in want.items():  # as a whole (AdamW divides near-zero gradients: single entries differ)
            assert (final[name] - tensor).norm() <= 1e-4 * tensor.norm(), name
