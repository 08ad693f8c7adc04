"""Qwen3.5's multi-token-prediction head against a reference built from the published implementation (vLLM's and
SGLang's Qwen3.5 MTP modules: the pre-fc norms, ``fc`` over [embedding of t+1; final hidden state at t], one
full-attention block with the MoE block and its final norm, run here as transformers' one-layer Qwen3.5 text model
fed those embeddings, with the shared LM head) in fp32, on one document and on packed documents; its gradients
by finite differences in float64; and the batch it trains on (the shift, the document ends, the ignored labels)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

import train
from core.constants import IGNORE_INDEX
from models import build_args, get_spec
from models.causal_lm import MtpBatch, mtp_batch
from models.hf_io import export_hf, load_hf_state_dict
from models.qwen3_5_moe.layers import OffsetRMSNorm
from tests.test_qwen35_parity import ARCH, _hf_config

MTP_ARCH = dict(ARCH, mtp_loss_weight=0.5)
DOCS = [[9, 17, 6], [32]]  # two rows of 32 tokens: three packed documents, one whole


def _model(arch: dict = MTP_ARCH, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    model = get_spec("qwen3_5_moe").model_cls(build_args("qwen3_5_moe", arch))
    model.init_weights()
    with torch.no_grad():  # norms away from their (1 + w) init of 0, so a misplaced or swapped norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.to(dtype).eval()


def _reference(model: torch.nn.Module) -> tuple[transformers.PreTrainedModel, transformers.PreTrainedModel]:
    """transformers' Qwen3.5 text model with our weights, and the MTP head as SGLang builds it: a one-layer
    Qwen3.5 model (full attention) whose layer and norm are mtp.layers.0 and mtp.norm."""
    main = transformers.Qwen3_5MoeForCausalLM(_hf_config(ARCH)).float().eval()
    main.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")}, strict=True)
    head = transformers.Qwen3_5MoeTextModel(_hf_config({**ARCH, "num_hidden_layers": 1,
                                                         "layer_types": ["full_attention"]})).float().eval()
    state = {k.removeprefix("mtp."): v for k, v in model.state_dict().items() if k.startswith("mtp.layers.")}
    head.load_state_dict({**state, "norm.weight": model.mtp.norm.weight,
                          "embed_tokens.weight": model.model.embed_tokens.weight}, strict=True)
    for m in (main, head):
        m.set_experts_implementation("eager")
    return main, head


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Qwen3.5's (1 + w) RMSNorm (vLLM's GemmaRMSNorm), in fp32."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


@torch.no_grad()
def _reference_document(model, main, head, ids_T: torch.Tensor) -> torch.Tensor:
    """The published MTP forward on one document: logits at t of token t+2, for t = 0 .. n - 3."""
    h_TD = main.model(input_ids=ids_T[None]).last_hidden_state[0, :-1]  # the target's hidden states, final-normed
    embeds_TD = main.model.embed_tokens(ids_T[1:])  # token t+1
    mtp = model.mtp
    x_TD = F.linear(torch.cat([_rms(embeds_TD, mtp.pre_fc_norm_embedding.weight),
                               _rms(h_TD, mtp.pre_fc_norm_hidden.weight)], dim=-1), mtp.fc.weight)
    positions = torch.arange(len(x_TD))[None]
    out_TD = head(inputs_embeds=x_TD[None], position_ids=positions).last_hidden_state[0]
    return main.lm_head(out_TD)[:-1]  # the last one's token t+2 is past the document


def _packed(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input ids, labels (the next token; the window's last one ignored) and position ids of DOCS."""
    T = sum(DOCS[0])
    ids_BT = torch.randint(0, ARCH["vocab_size"], (len(DOCS), T), generator=torch.Generator().manual_seed(seed))
    labels_BT = ids_BT.roll(-1, dims=1)
    labels_BT[:, -1] = IGNORE_INDEX
    position_ids_BT = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCS])
    return ids_BT, labels_BT, position_ids_BT


def test_mtp_logits_and_loss_match_the_published_head() -> None:
    model = _model()
    main, head = _reference(model)
    ids_BT, labels_BT, position_ids_BT = _packed(seed=3)
    batch = mtp_batch(ids_BT, labels_BT, position_ids_BT)
    mtp = MtpBatch(batch["mtp_input_ids"], batch["mtp_labels"])
    with torch.no_grad():
        out = model(ids_BT, position_ids_BT, mtp=mtp)
        loss = model(ids_BT, position_ids_BT, labels_BT, mtp=mtp).mtp_loss_sum
    ref_loss, pairs = 0.0, 0
    for b, lengths in enumerate(DOCS):  # each document on its own, as the published head runs it
        for start, n in zip(np.cumsum([0, *lengths[:-1]]), lengths):
            ref_logits = _reference_document(model, main, head, ids_BT[b, start:start + n])
            logits = out.mtp_logits[b, start:start + n - 2]
            # fp32 round-off through five layers (the parity tests' bound): 1e-5 relative, norm-wise
            assert ((logits - ref_logits).norm() / ref_logits.norm()).item() < 1e-5, (b, start)
            assert (batch["mtp_labels"][b, start:start + n - 2] == ids_BT[b, start + 2:start + n]).all()
            ref_loss += F.cross_entropy(ref_logits, ids_BT[b, start + 2:start + n], reduction="sum")
            pairs += n - 2
    assert (batch["mtp_labels"] != IGNORE_INDEX).sum() == pairs  # every other pair crosses a document end
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    # One document per row gives the same as the published head on each row (the unpacked path).
    ids_BT, labels_BT = ids_BT[1:], labels_BT[1:]
    batch = mtp_batch(ids_BT, labels_BT, torch.arange(ids_BT.shape[1])[None])
    with torch.no_grad():
        logits = model(ids_BT, mtp=MtpBatch(batch["mtp_input_ids"], batch["mtp_labels"])).mtp_logits[0, :-2]
    ref_logits = _reference_document(model, main, head, ids_BT[0])
    assert ((logits - ref_logits).norm() / ref_logits.norm()).item() < 1e-5


def test_mtp_batch_masks_document_ends_and_ignored_labels() -> None:
    ids_BT, labels_BT, position_ids_BT = _packed(seed=4)
    labels_BT[0, 4] = labels_BT[1, 20] = IGNORE_INDEX  # e.g. a prompt token
    batch = mtp_batch(ids_BT, labels_BT, position_ids_BT)
    T = ids_BT.shape[1]
    for b, lengths in enumerate(DOCS):
        doc_T = np.repeat(np.arange(len(lengths)), lengths)
        for t in range(T):
            crosses = t + 2 < T and doc_T[t + 2] != doc_T[t] or t + 1 < T and doc_T[t + 1] != doc_T[t]
            expected = IGNORE_INDEX if t == T - 1 or crosses else labels_BT[b, t + 1].item()
            assert batch["mtp_labels"][b, t].item() == expected, (b, t)
            if t < T - 1:
                assert batch["mtp_input_ids"][b, t] == ids_BT[b, t + 1]
    # Multimodal [3, B, T] position ids: one document per row, as for the attention.
    three = mtp_batch(ids_BT, labels_BT, position_ids_BT.expand(3, *position_ids_BT.shape))
    assert (three["mtp_labels"][:, :-1] == labels_BT[:, 1:]).all()


def _float64_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """offset_rms_norm without its cast to fp32, for finite differences in float64."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight)


def test_mtp_gradients_match_finite_differences() -> None:
    """The MTP loss's gradient (float64) w.r.t. the head's norms, fc, an attention and an expert weight of its block
    and the shared embedding, against central differences: the backward through the block, the shared LM head and
    the concatenation. The summed loss (the chunked LM head's backward) gives the same gradient as the logits'."""
    arch = dict(MTP_ARCH, hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                linear_key_head_dim=4, linear_value_head_dim=4, num_hidden_layers=2,
                layer_types=["linear_attention", "full_attention"], moe_intermediate_size=8,
                shared_expert_intermediate_size=8, vocab_size=32)
    model = _model(arch, torch.float64)
    for module in model.modules():  # the (1 + w) norms in float64 (they normalise in fp32 otherwise)
        if isinstance(module, OffsetRMSNorm):
            module.norm_fn = _float64_norm
    ids_BT, labels_BT, position_ids_BT = _packed(seed=5)
    ids_BT, labels_BT = ids_BT % 32, labels_BT.where(labels_BT < 0, labels_BT % 32)
    batch = mtp_batch(ids_BT, labels_BT, position_ids_BT)
    mtp = MtpBatch(batch["mtp_input_ids"], batch["mtp_labels"])
    params = dict(model.named_parameters())

    def loss() -> torch.Tensor:
        logits = model(ids_BT, position_ids_BT, mtp=mtp).mtp_logits
        return F.cross_entropy(logits.flatten(0, 1), mtp.labels_BT.flatten(), ignore_index=IGNORE_INDEX)

    summed = model(ids_BT, position_ids_BT, labels_BT, mtp=mtp).mtp_loss_sum / (mtp.labels_BT != IGNORE_INDEX).sum()
    summed_grads = dict(zip(params, torch.autograd.grad(summed, list(params.values()), allow_unused=True)))
    loss().backward()
    for name, p in params.items():
        if name.startswith("mtp.") or name == "model.embed_tokens.weight":
            # the chunked head's softmax runs in fp32: fp32 round-off (measured 5e-5 relative, 1e-7 absolute)
            torch.testing.assert_close(summed_grads[name], p.grad, rtol=2e-4, atol=1e-6)
    names = ["mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight", "mtp.fc.weight",
             "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.mlp.experts.gate_up_proj",
             "model.embed_tokens.weight"]
    for name in names:
        p = params[name]
        flat, grad = p.detach().view(-1), p.grad.view(-1)
        for i in grad.abs().topk(3).indices.tolist():  # the largest entries: a wrong backward shows there
            eps, saved = 1e-4, flat[i].item()
            with torch.no_grad():
                flat[i] = saved + eps
                up = loss().item()
                flat[i] = saved - eps
                down = loss().item()
                flat[i] = saved
            numeric = (up - down) / (2 * eps)
            # Central differences: truncation ~eps^2 (1e-8; at eps 1e-3 a routing change upstream of the embedding
            # showed, 0.4%); the fp32 router softmax and DeltaNet decay leave round-off in the loss: 2e-4 + 1e-3
            # relative.
            assert abs(grad[i].item() - numeric) < 2e-4 + 1e-3 * abs(numeric), (name, i, grad[i].item(), numeric)
            assert abs(numeric) > 1e-3, (name, i)  # a gradient to check, not round-off


def test_mtp_head_loads_from_per_expert_and_fused_names(tmp_path) -> None:
    """Exported (per-expert names, as published) or saved fused (our names), the head's tensors load back exactly;
    a model without the head leaves them to the export (not loaded, not refused)."""
    model = _model()
    state = {k: v for k, v in model.state_dict().items() if "expert_bias" not in k}
    export_hf(model, "qwen3_5_moe_text", tmp_path / "per_expert")
    assert "mtp.layers.0.mlp.experts.3.up_proj.weight" in load_file(tmp_path / "per_expert" / "model.safetensors")
    (tmp_path / "fused").mkdir()
    save_file(state, tmp_path / "fused" / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(tmp_path / "per_expert" / "config.json", tmp_path / "fused")
    for layout in ("per_expert", "fused"):
        loaded = load_hf_state_dict(tmp_path / layout, mtp=True)
        assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state), layout
        assert not any(k.startswith("mtp.") for k in load_hf_state_dict(tmp_path / layout)), layout


MTP_TINY = ["model=qwen35_moe_debug", "model.arch.vocab_size=256", "model.arch.hidden_size=32",
            "model.arch.moe_intermediate_size=16", "model.arch.shared_expert_intermediate_size=16"]


def test_a_train_steps_mtp_loss_and_gradient_are_its_weight_times_its_own_mean(tiny_run_config, tmp_path,
                                                                             monkeypatch) -> None:
    """train.py's step against the arithmetic done by hand: its logged ``mtp_loss`` is the MTP head's cross-entropy
    summed over the step's micro-batches divided by the MTP head's own trained labels (not the main loss's), and the
    gradient of the head's parameters is ``mtp_loss_weight`` x that mean's (the router losses off, so that nothing
    else reaches them). Two micro-batches of packed documents: the MTP count (pairs crossing a document end and the
    window's last position ignored) differs from the main one."""
    weight, docs = 0.3, tmp_path / "documents.npy"
    ids = np.random.default_rng(0).integers(1, 256, size=4096)
    ids[np.random.default_rng(1).random(4096) < 0.2] = 0  # documents of about 5 tokens, each ended by id 0
    np.save(docs, ids)
    cfg = tiny_run_config(*MTP_TINY, f"model.arch.mtp_loss_weight={weight}", "model.arch.router_aux_loss_coef=0",
                          f"data.path={docs}", "data.eos_id=0", "data.seq_len=16", "train.local_batch_size=2",
                          "train.grad_accum_steps=2", "train.steps=0")
    seen: dict = {}
    original = train.queue_step

    def by_hand(model, batches, *args, **kwargs):
        queued = original(model, batches, *args, **kwargs)  # train.steps=0: no update, the gradients kept to here
        head = {name: p for name, p in model.named_parameters() if name.startswith("mtp.")}
        seen["grads"] = {name: p.grad.clone() for name, p in head.items()}
        ce_sum = 0.0
        for b in batches:
            logits = model(b.input_ids, b.position_ids, packed=b.packed, mtp=MtpBatch(b.mtp.input_ids_BT,
                                                                                    b.mtp.labels_BT)).mtp_logits
            ce_sum = ce_sum + F.cross_entropy(logits.flatten(0, 1).float(), b.mtp.labels_BT.flatten(),
                                              ignore_index=IGNORE_INDEX, reduction="sum")
        count = sum(int((b.mtp.labels_BT != IGNORE_INDEX).sum()) for b in batches)
        seen["counts"] = (count, sum(int((b.labels != IGNORE_INDEX).sum()) for b in batches))
        seen["mtp_loss"] = (ce_sum / count).item()
        seen["expected"] = dict(zip(head, torch.autograd.grad(weight * ce_sum / count, list(head.values()))))
        seen["read"] = queued.read().tolist()
        return queued

    monkeypatch.setattr(train, "queue_step", by_hand)
    history = train.run(cfg)
    mtp_count, main_count = seen["counts"]
    assert 0 < mtp_count < main_count * 0.8  # the window's last pair and the pairs crossing a document end ignored
    assert history[0]["mtp_loss"] == pytest.approx(seen["mtp_loss"], rel=1e-5)
    assert seen["read"][3] == pytest.approx(seen["mtp_loss"], rel=1e-5)
    assert "mtp.fc.weight" in seen["grads"] and "mtp.layers.0.mlp.experts.gate_up_proj" in seen["grads"]
    for name, grad in seen["grads"].items():
        torch.testing.assert_close(grad, seen["expected"][name], rtol=1e-4, atol=1e-8, msg=name)
