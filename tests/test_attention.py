"""Document-causal attention (``kernels/attention/attention.py``) in fp32 on CPU: FlexAttention's block mask against
torch's own ``create_block_mask``, and FlexAttention (eager) and the varlen wrapper (around a per-document SDPA with
varlen_attn's signature: the real op is CUDA-only) against the dense-mask reference and against every document run
on its own, outputs and q/k/v gradients; both families' models forward + backward with each kernel against the
reference; the documents built once per forward and reused by recomputation; the registry's choice. The real
kernels (compiled flex, torch's varlen_attn) on CUDA at the end, and in ``scripts/check_kernels.py``."""

from __future__ import annotations

import copy
import re
from dataclasses import replace

import pytest
import torch
from torch.nn.attention import flex_attention as flex_module
from torch.nn.attention.flex_attention import create_block_mask

import models
from core.constants import IGNORE_INDEX
from kernels.attention.attention import (DenseMaskAttention, Documents, FlexAttention, VarlenAttention, causal_sdpa,
                               document_block_mask, document_cu_seqlens)
from kernels.config import KernelConfig, validate_kernel_config
from kernels import registry
from kernels.registry import CUDA_ATTENTION, Env, select_kernels
from models.layers import document_ids, known_documents
from parallelisms.activation_checkpoint import apply_activation_checkpointing
from training.metrics import attended_flops_per_token

# Row 0: one-token documents, documents crossing the 128-token block boundaries (127 | 130 | ...), a short tail;
# row 1: one document (a window that is one document, in a packed batch).
LENGTHS = [[1, 127, 130, 1, 1, 40], [300]]
T = 300
H, h, d = 4, 2, 16


def position_ids(lengths: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])


def per_document_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor,
                      cu_seq_k: torch.Tensor, max_q: int, max_k: int, *, scale: float | None = None,
                      window_size: tuple[int, int] = (-1, -1), enable_gqa: bool = False) -> torch.Tensor:
    """torch.nn.attention.varlen.varlen_attn's signature and meaning ([N, heads, d] tokens, causal for window
    (-1, 0)), computed as causal SDPA on every document alone: the CPU stand-in for the CUDA op."""
    assert window_size == (-1, 0) and torch.equal(cu_seq_q, cu_seq_k) and cu_seq_q.dtype == torch.int32
    assert max_q == max_k == int(cu_seq_q.diff().max())
    bounds = cu_seq_q.tolist()
    outs = [causal_sdpa(*(x[s:e].transpose(0, 1)[None] for x in (query, key, value)), scale)[0].transpose(0, 1)
            for s, e in zip(bounds, bounds[1:])]
    return torch.cat(outs)


@pytest.fixture
def flex_backward_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """GLUE: torch refuses flex_attention's backward on CPU tensors (inductor has no CPU backward); eager, its
    autograd is the exact math over every (q, kv) pair with our mask_mod, which is what these tests check. The block
    structure, which eager ignores, is checked against create_block_mask."""
    monkeypatch.setattr(flex_module, "_validate_device", lambda *tensors: None)


def qkv(B: int = 2, seed: int = 0, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, n, T, d, generator=gen, dtype=dtype).requires_grad_() for n in (H, h, h)]


def out_and_grads(attention, docs: Documents | None, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    leaves = [x.detach().clone().requires_grad_() for x in tensors]
    out = attention(*leaves, docs, d**-0.5)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out))
    return [out.detach(), *(x.grad for x in leaves)]


def each_document_alone(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Output and q/k/v gradients with every document run as a sequence of its own."""
    leaves = [x.detach().clone().requires_grad_() for x in tensors]
    rows = []
    for b, lengths in enumerate(LENGTHS):
        bounds = torch.tensor([0, *lengths]).cumsum(0).tolist()
        rows.append(torch.cat([causal_sdpa(*(x[b:b + 1, :, s:e] for x in leaves), d**-0.5)
                               for s, e in zip(bounds, bounds[1:])], dim=2))
    out = torch.cat(rows)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out))
    return [out.detach(), *(x.grad for x in leaves)]


# Each kernel as the CPU runs it: FlexAttention eagerly, the varlen wrapper around the per-document stand-in.
IMPLS = {"flex_attention": lambda: FlexAttention(compiled=False),
         "varlen_attn": lambda: VarlenAttention(per_document_sdpa)}


@pytest.mark.parametrize("name", IMPLS)
def test_kernel_equals_dense_mask_and_documents_alone(flex_backward_on_cpu, name: str) -> None:
    """In float64, to 1e-6: a mask or block error moves values by O(0.1-1). (Run alone, the three agree to 1e-15;
    in full-suite runs dq has, now and then, differed by up to 2e-9 in float64 and by over 1e-5 in fp32, on this
    machine and a CI one; not reproduced in isolation, so the tolerance leaves room for it.)"""
    attention, tensors = IMPLS[name](), qkv(dtype=torch.float64)
    ids_BT = document_ids(position_ids(LENGTHS))
    got = out_and_grads(attention, attention.documents(ids_BT), tensors)
    dense = out_and_grads(DenseMaskAttention(), DenseMaskAttention().documents(ids_BT), tensors)
    alone = each_document_alone(tensors)
    for g, r, a, what in zip(got, dense, alone, ["out", "dq", "dk", "dv"]):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6, msg=lambda m: f"{what} vs dense mask: {m}")
        torch.testing.assert_close(g, a, rtol=1e-6, atol=1e-6, msg=lambda m: f"{what} vs each document alone: {m}")
    causal = out_and_grads(attention, None, tensors)  # no documents: one causal sequence per row
    assert not torch.allclose(causal[0][0], got[0][0], atol=1e-3)  # row 0's documents really were separated
    torch.testing.assert_close(causal[0][1], got[0][1], rtol=1e-6, atol=1e-6)  # row 1 is one document


@pytest.mark.parametrize("lengths", [LENGTHS, [[128, 128, 44], [1] * 300], [[256, 44], [299, 1]], [[300], [300]]])
def test_block_mask_equals_create_block_mask(lengths: list[list[int]]) -> None:
    ids_BT = _ids(lengths)
    got = document_block_mask(ids_BT)
    want = create_block_mask(lambda b, hh, q, kv: (ids_BT[b, q] == ids_BT[b, kv]) & (q >= kv), len(lengths), None,
                             T, T, device="cpu")
    for field in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                  "q_indices", "full_q_num_blocks", "full_q_indices"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    assert got.seq_lengths == (T, T)
    q, kv = torch.meshgrid(torch.arange(T), torch.arange(T), indexing="ij")
    for b in range(len(lengths)):  # the mask_mod, on every pair
        want_TT = (ids_BT[b][:, None] == ids_BT[b][None, :]) & (q >= kv)
        assert torch.equal(got.mask_mod(torch.tensor(b), torch.tensor(0), q, kv), want_TT)


def _ids(lengths: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in lengths])


def test_block_mask_skips_cross_document_blocks_at_128k() -> None:
    """A 131,072-token window of 2,048-token documents: blocks and memory O((T / 128)^2), a document's band only."""
    ids_BT = torch.arange(131072).div(2048, rounding_mode="floor")[None]
    mask = document_block_mask(ids_BT)
    blocks = mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum()
    assert blocks == 64 * (16 * 17 // 2)  # 64 documents of 16 blocks, each its causal triangle
    assert mask.kv_indices.shape == (1, 1, 1024, 1024)


def test_cu_seqlens_over_the_flattened_batch() -> None:
    cu = document_cu_seqlens(document_ids(position_ids(LENGTHS)))
    assert cu.tolist() == [0, 1, 128, 258, 259, 260, 300, 600]


def test_varlen_documents_carry_the_longest_document() -> None:
    docs = VarlenAttention(per_document_sdpa).documents(document_ids(position_ids(LENGTHS)))
    assert docs.max_len == 300 and docs.block_mask is None


# --- the models ---------------------------------------------------------------------------------------------------

FAMILIES = {
    "qwen3_moe": dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=16, initializer_range=0.1),
    # full attention every 2nd layer: partial rotary and the output gate, beside DeltaNet on FLA-style cu_seqlens
    "qwen3_5_moe": dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, full_attention_interval=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12, num_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                        initializer_range=0.1),
}
# Two documents crossing the 128 block boundary, a one-token document, and a padding run (its labels ignored).
MODEL_LENGTHS = [[100, 60, 1, 39], [200]]
PAD = 0


def tiny_model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = models.get_spec(family).model_cls(models.build_args(family, FAMILIES[family]))
    model.init_weights()
    return model


def use_attention(model: torch.nn.Module, attention) -> torch.nn.Module:
    """Fill every ``document_attention`` slot (the decoder's and each attention layer's) with ``attention``."""
    for module in model.modules():
        for attr, op in getattr(module, "kernel_slots", {}).items():
            if op == "document_attention":
                setattr(module, attr, attention)
    return model


def packed_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    input_ids_BT = torch.randint(1, 96, (2, 200), generator=gen)
    input_ids_BT[0, 161:] = PAD
    labels_BT = torch.randint(1, 96, (2, 200), generator=gen)
    labels_BT[0, 161:] = IGNORE_INDEX  # padding
    labels_BT[1, :50] = IGNORE_INDEX  # an untrained prompt
    return input_ids_BT, position_ids(MODEL_LENGTHS), labels_BT


def loss_and_grads(model: torch.nn.Module) -> list[torch.Tensor]:
    input_ids_BT, position_ids_BT, labels_BT = packed_inputs()
    loss = model(input_ids_BT, position_ids_BT, labels_BT).loss_sum
    loss.backward()
    return [loss.detach(), *(p.grad for p in model.parameters())]


@pytest.mark.parametrize("name", IMPLS)
@pytest.mark.parametrize("family", FAMILIES)
def test_model_trains_like_the_dense_mask(flex_backward_on_cpu, family: str, name: str) -> None:
    reference = tiny_model(family)
    model = use_attention(copy.deepcopy(reference), IMPLS[name]())
    got, want = loss_and_grads(model), loss_and_grads(reference)
    names = ["loss", *(n for n, _ in reference.named_parameters())]
    for g, w, what in zip(got, want, names):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=lambda m, what=what: f"{what}: {m}")


@pytest.mark.parametrize("family", FAMILIES)
def test_model_packed_rows_equal_documents_alone(family: str) -> None:
    model = use_attention(tiny_model(family), FlexAttention(compiled=False))
    input_ids_BT, position_ids_BT, _ = packed_inputs()
    with torch.no_grad():
        packed = model(input_ids_BT, position_ids_BT).logits
        for b, lengths in enumerate(MODEL_LENGTHS):
            bounds = torch.tensor([0, *lengths]).cumsum(0).tolist()
            alone = torch.cat([model(input_ids_BT[b:b + 1, s:e]).logits for s, e in zip(bounds, bounds[1:])], 1)
            torch.testing.assert_close(packed[b:b + 1], alone, rtol=1e-4, atol=1e-5)


class Recording(VarlenAttention):
    """The varlen wrapper, recording each ``documents`` build and the documents every call was given."""

    def __init__(self) -> None:
        super().__init__(per_document_sdpa)
        self.built: list[Documents] = []
        self.seen: list[Documents | None] = []

    def documents(self, ids_BT: torch.Tensor, known=None) -> Documents:
        self.built.append(super().documents(ids_BT, known))
        return self.built[-1]

    def __call__(self, q_BHTd, k_BhTd, v_BhTd, docs, scale):
        self.seen.append(docs)
        return super().__call__(q_BHTd, k_BhTd, v_BhTd, docs, scale)


@pytest.mark.parametrize("family", FAMILIES)
def test_documents_built_once_and_shared_through_recomputation(family: str) -> None:
    model, recording = tiny_model(family), Recording()
    use_attention(model, recording)
    apply_activation_checkpointing(model.model.layers, "full")
    loss_and_grads(model)
    attention_layers = sum(hasattr(layer, "self_attn") for layer in model.model.layers)
    assert len(recording.built) == 1  # once per forward, before the layers
    assert len(recording.seen) == 2 * attention_layers  # forward + recompute
    assert all(docs is recording.built[0] for docs in recording.seen)


def test_unpacked_rows_build_no_documents() -> None:
    model, recording = tiny_model("qwen3_moe"), Recording()
    use_attention(model, recording)
    model(torch.randint(1, 96, (2, 40)))
    assert recording.built == [] and recording.seen == [None, None]  # the causal flash path


# --- the registry -------------------------------------------------------------------------------------------------

HOPPER = Env("cuda", triton_version="3.6.0", capability=(9, 0), cudnn_frontend_version="1.14.0", cudnn_version=91900)


def _choose(cfg: KernelConfig, env: Env = HOPPER):
    return select_kernels(cfg, env.device_type, env).choices["document_attention"]


def test_cuda_default_and_named_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    choose = _choose
    # measured faster end to end: docs/results.md#packed-documents-and-long-windows
    assert choose(KernelConfig()).impl == CUDA_ATTENTION == "varlen_attn"
    for name in ("cudnn_attention", "varlen_attn", "flex_attention", "torch"):
        assert choose(KernelConfig(attention=name)).impl == name
    assert choose(KernelConfig(), Env("cpu")).impl == "torch"
    # auto names the preferred kernels it passed over, and why
    passed_over = choose(KernelConfig(), replace(HOPPER, capability=(7, 5))).reason
    assert "not varlen_attn: flash attention needs sm_80" in passed_over
    # named without cudnn-frontend, on an Ampere GPU or with an old cuDNN, it fails saying why
    for env, why in ((replace(HOPPER, cudnn_frontend_version=None), r"pip install '\.\[gpu\]'"),
                     (replace(HOPPER, capability=(8, 0)), "needs sm_90 or newer, this GPU is sm_80"),
                     (replace(HOPPER, cudnn_version=90100), "loads cuDNN 90100; .* need 90600"),
                     (replace(HOPPER, cudnn_version=None), "cudnn-frontend 1.14.0 cannot load cuDNN")):
        with pytest.raises(ValueError, match=r"kernel_config\.attention=cudnn_attention cannot run on .*" + why):
            choose(KernelConfig(attention="cudnn_attention"), env)
    assert choose(KernelConfig(), Env("cuda", capability=(9, 0))).impl == "varlen_attn"  # no triton: no flex
    with pytest.raises(ValueError, match=r"kernel_config\.attention=varlen_attn cannot run on .*sm_80"):
        choose(KernelConfig(attention="varlen_attn"), Env("cuda", triton_version="3.6.0", capability=(7, 5)))
    with pytest.raises(ValueError, match=r"kernel_config\.attention=flex_attention cannot run on cpu"):
        choose(KernelConfig(attention="flex_attention"), Env("cpu"))
    # cuDNN is opt-in: auto never takes it, not even where it alone could run (no varlen, no triton for flex)
    monkeypatch.setattr(registry, "varlen_signature_problem", lambda: "no varlen_attn in this torch")
    assert choose(KernelConfig(), replace(HOPPER, triton_version=None)).impl == "torch"
    assert choose(KernelConfig(attention="cudnn_attention"), replace(HOPPER, triton_version=None)).impl == (
        "cudnn_attention")


@pytest.mark.parametrize("cfg, match", [
    (KernelConfig(attention="flash"),
     r"kernel_config\.attention='flash': expected one of auto, cudnn_attention, flex_attention"),
    (KernelConfig(name="flash-linear-attention", attention="varlen_attn"), r"add auto to kernel_config\.name"),
])
def test_bad_attention_config(cfg: KernelConfig, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        validate_kernel_config(cfg)


def test_documents_the_host_knows_equal_the_ones_found_on_the_device() -> None:
    """The trainer reads each window's offsets from its host copy (``known_documents``): every implementation then
    builds the Documents it would have found, with no device read; unpacked rows are False."""
    pos_BT = position_ids(LENGTHS)
    known = known_documents(pos_BT, torch.device("cpu"))
    assert known_documents(torch.arange(T).expand(2, T), torch.device("cpu")) is False
    for attention in (DenseMaskAttention(), VarlenAttention(per_document_sdpa)):
        found, told = (attention.documents(document_ids(pos_BT, packed), k) for packed, k in ((None, None),
                                                                                              (known, known)))
        assert torch.equal(found.ids_BT, told.ids_BT) and torch.equal(found.cu_seqlens_n1, told.cu_seqlens_n1)
        assert found.max_len == told.max_len


# --- the real kernels, on CUDA ------------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (cuDNN, torch's varlen_attn, compiled flex)")
@pytest.mark.parametrize("name", ["cudnn_attention", "flex_attention", "varlen_attn"])
@pytest.mark.parametrize("heads", [(H, h, d), (16, 2, 256)], ids=["d16", "qwen3.5 d256"])
def test_cuda_kernels_equal_the_dense_mask(name: str, heads: tuple[int, int, int]) -> None:
    """bf16 against the fp32 reference, on both rows' documents (one-token ones, 128-block crossings, a row that is
    one document) and in the model's [B, T, heads, d] memory layout."""
    try:
        attention = select_kernels(KernelConfig(attention=name), "cuda").get("document_attention")
    except ValueError as error:
        pytest.skip(str(error))
    nq, nkv, dim = heads
    ids_BT = document_ids(position_ids(LENGTHS)).cuda()
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(2, T, n, dim, generator=gen).cuda().bfloat16().transpose(1, 2) for n in (nq, nkv, nkv)]
    outs = []
    for impl, xs in ((attention, tensors), (DenseMaskAttention(), [x.float() for x in tensors])):
        leaves = [x.detach().clone().requires_grad_() for x in xs]
        out = impl(*leaves, impl.documents(ids_BT), dim**-0.5)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out))
        outs.append([out.detach(), *(x.grad for x in leaves)])
    for g, w, what in zip(*outs, ("out", "dq", "dk", "dv")):
        assert ((g.float() - w).norm() / w.norm()).item() < 2e-2, what  # bf16 against fp32


def test_mask_dtype_sanity() -> None:
    """The reference's mask is boolean (SDPA would add a float mask): True = attended."""
    docs = DenseMaskAttention().documents(document_ids(position_ids([[2, 1]]).expand(1, 3)))
    q = torch.zeros(1, 1, 3, 4)
    v = torch.arange(3.0).view(1, 1, 3, 1).expand(1, 1, 3, 4)
    out = DenseMaskAttention()(q, q, v, docs, 1.0)
    assert out[0, 0, :, 0].tolist() == [0.0, 0.5, 2.0]  # uniform over each query's own document so far


# --- accounting ---------------------------------------------------------------------------------------------------

def attended_documents(lengths: list[list[int]]):
    """The trainer's ``packed`` for rows of these document lengths."""
    return known_documents(position_ids(lengths), torch.device("cpu"))


@pytest.mark.parametrize("family", FAMILIES)
def test_attended_flops_count_each_documents_causal_half(family: str) -> None:
    args = models.build_args(family, FAMILIES[family])
    base = args.flops_per_token(0)
    attention_layers = {"qwen3_moe": 2, "qwen3_5_moe": 1}[family]  # Qwen3.5: every 2nd layer; DeltaNet is in base
    per_pair = 12 * attention_layers * args.num_attention_heads * args.head_dim  # scores and values, fwd + bwd
    assert args.flops_per_token(1) - base == per_pair
    # lengths 3, 1 | 4: (9 + 1 + 16) / 2 attended pairs over 8 tokens
    got = attended_flops_per_token(args, attended_documents([[3, 1], [4]]), (2, 4))
    assert got == pytest.approx(base + per_pair * 26 / 2 / 8)
    # Multimodal [3, B, T] ids: one document per row, as the model attends them, whatever row 0's jumps.
    mrope_3BT = position_ids([[3, 1], [4]]).expand(3, 2, 4)
    assert known_documents(mrope_3BT, torch.device("cpu")) is False
    assert attended_flops_per_token(args, False, (2, 4)) == pytest.approx(base + per_pair * 32 / 2 / 8)
    # A 32k window of 2,048-token documents attends 1/16 of one causal 32k sequence's pairs, which is half of what
    # the headline flops_per_token counts (torchtitan's convention: no causal halving).
    packed = attended_flops_per_token(args, attended_documents([[2048] * 16]), (1, 32768))
    causal = attended_flops_per_token(args, known_documents(torch.arange(32768)[None], torch.device("cpu")),
                                      (1, 32768))
    assert (packed - base) * 16 == pytest.approx(causal - base)
    assert (causal - base) * 2 == pytest.approx(args.flops_per_token(32768) - base)


@pytest.mark.parametrize("family", FAMILIES)
def test_attended_flops_count_the_lm_head_over_the_trained_labels_only(family: str) -> None:
    """A window with half its labels ignored saves half the LM head's 6 x hidden x vocab per token, which
    ``flops_per_token`` counts for an untied head only (a tied one is the embedding, left out with it)."""
    args = models.build_args(family, FAMILIES[family])
    tied = models.build_args(family, {**FAMILIES[family], "tie_word_embeddings": True})
    head = 6 * args.hidden_size * args.vocab_size
    assert args.flops_per_token(4) - tied.flops_per_token(4) == head
    labels_BT = torch.randint(0, args.vocab_size, (2, 4))
    labels_BT[:, ::2] = IGNORE_INDEX
    half = (labels_BT != IGNORE_INDEX).double().mean().item()
    for a, saved in ((args, head / 2), (tied, 0)):
        every = attended_flops_per_token(a, False, (2, 4))
        assert every - attended_flops_per_token(a, False, (2, 4), half) == pytest.approx(saved)
