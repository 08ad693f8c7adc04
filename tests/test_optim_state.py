"""optim.state_dtype: AdamW with bf16 moments beside fp32 master weights (``training.optim.AdamW``), against
torch.optim.AdamW in fp32; its state's memory; its checkpoints (exact resume, and a float32-state checkpoint
resumed with bfloat16 moments, converted, when train.allow_changes names the key)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import models
import train
from tests.dist_utils import debug_model_args, seeded_weights
from tests.test_checkpoint import losses
from training.checkpoint import load_checkpoint
from training.config import OptimConfig, validate
from parallelisms.grad_norm import clip_coefficient
from training.optim import AdamW, build_optimizer, clipped_step, queue_step
from training import startup

pytestmark = pytest.mark.torch_apis  # DCP checkpoints of the optimizer state

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
STEPS = 20


def _problem(seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A weight matrix, a bias and their gradients at every step (fixed, so every optimizer sees the same ones)."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(64, 48, generator=g), torch.randn(48, generator=g)]
    grads = [[torch.randn(p.shape, generator=g) * (0.1 + step / STEPS) for p in params] for step in range(STEPS)]
    return params, grads


def _train(make_optimizer) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    init, grads = _problem()
    params = [p.clone().requires_grad_() for p in init]
    optimizer = make_optimizer([{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:],
                                                                                "weight_decay": 0.0}])
    for step_grads in grads:
        for p, grad in zip(params, step_grads):
            p.grad = grad.clone()
        optimizer.step()
    return [p.detach() for p in params], optimizer


def test_float32_moments_are_torch_adamw_to_the_bit() -> None:
    want, _ = _train(lambda groups: torch.optim.AdamW(groups, **HYPER, foreach=False))
    got, _ = _train(lambda groups: AdamW(groups, **HYPER, state_dtype=torch.float32))
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_the_clip_inside_the_update_is_the_clip_of_the_gradients_first(state_dtype: torch.dtype) -> None:
    """clipped_step folds the clip coefficient into AdamW's update (no pass over the gradients, which stay as they
    are): the same parameters, to the bit, as scaling the gradients in place and stepping; torch's AdamW gets them
    scaled in place."""
    norms = [4.0 if step % 3 else 0.5 for step in range(STEPS)]  # clipped (to 1.0) and unclipped steps
    runs = []
    for fold in (True, False):
        init, grads = _problem()
        params = [torch.nn.Parameter(p.clone()) for p in init]
        model = torch.nn.ParameterList(params)
        optimizer = AdamW([{"params": params, "weight_decay": 0.1}], **HYPER, state_dtype=state_dtype)
        for step_grads, norm in zip(grads, norms):
            for p, grad in zip(params, step_grads):
                p.grad = grad.clone()
            if fold:
                clipped_step(optimizer, model, 1.0, norm)
                assert all(torch.equal(p.grad, g) for p, g in zip(params, step_grads))  # left unscaled
            else:
                for p in params:
                    p.grad.mul_(clip_coefficient(1.0, norm))
                optimizer.step()
        runs.append([p.detach() for p in params])
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)
    init, grads = _problem()
    params = [torch.nn.Parameter(p.clone()) for p in init]  # ParameterList keeps Parameters as they are
    torch_adamw = torch.optim.AdamW(params, **HYPER, foreach=False)
    for p, grad in zip(params, grads[0]):
        p.grad = grad.clone()
    clipped_step(torch_adamw, torch.nn.ParameterList(params), 1.0, 2.0)
    assert all(torch.equal(p.grad, g * clip_coefficient(1.0, 2.0)) for p, g in zip(params, grads[0]))


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_a_step_queued_before_the_read_is_the_step_the_host_would_take(state_dtype: torch.dtype) -> None:
    """queue_step decides on the device what the trainer decides on the host after its read: the clip, and no
    update where the norm or a loss is not finite (then ``rewind``). Parameters, moments and step counters equal,
    to the bit, those of clipped_step on the steps the host applies and nothing on the others."""
    norms = [4.0 if step % 3 else 0.5 for step in range(STEPS)]
    losses = [[1.0, 0.1, 0.0]] * STEPS
    norms[4], losses[9], norms[13] = float("nan"), [1.0, float("inf"), 0.0], float("inf")  # steps not applied
    runs = []
    for queued in (True, False):
        init, grads = _problem()
        params = [torch.nn.Parameter(p.clone()) for p in init]
        model = torch.nn.ParameterList(params)
        optimizer = AdamW([{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "weight_decay": 0.0}],
                          **HYPER, state_dtype=state_dtype)
        for step_grads, norm, step_losses in zip(grads, norms, losses):
            for p, grad in zip(params, step_grads):
                p.grad = grad.clone()
            finite = all(map(math.isfinite, [norm, *step_losses]))
            if queued:
                assert queue_step(optimizer, 1.0, torch.tensor(norm), torch.tensor(step_losses))
                if not finite:
                    optimizer.rewind()
            elif finite:
                clipped_step(optimizer, model, 1.0, norm)
        runs.append((params, optimizer))
    (got, got_opt), (want, want_opt) = runs
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
        assert set(got_opt.state[a]) == set(want_opt.state[b]) == {"step", "exp_avg", "exp_avg_sq"}
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(got_opt.state[a][key], want_opt.state[b][key]), key
    assert float(got_opt.state[got[0]]["step"]) == STEPS - 3
    assert not queue_step(torch.optim.AdamW(got), 1.0, torch.tensor(1.0), torch.ones(3))  # torch's: after the read


def test_bfloat16_moments_follow_fp32_adamw_closely_with_half_the_state() -> None:
    init, _ = _problem()
    want, fp32 = _train(lambda groups: torch.optim.AdamW(groups, **HYPER, foreach=False))
    got, bf16 = _train(lambda groups: AdamW(groups, **HYPER, state_dtype=torch.bfloat16))
    # Each stored moment is rounded to 8 significant bits every step (relative 2^-9 on average, 2^-8 at most); the
    # rounding errors decay with the moment (by beta per step), so a moment carries at most ~2^-8 / (1 - beta)
    # relative (4% for exp_avg_sq at beta2 = 0.95, their random signs leave ~0.5%). The update m / sqrt(v) then
    # differs by about that: measured 1.9e-3 on this problem (3e-3 for the moments themselves), norm-wise over the whole displacement; 1e-2 leaves
    # room and still catches a wrong formula (an O(1) error) or a missing bias correction.
    for a, b, p0 in zip(got, want, init, strict=True):
        err = ((a - p0) - (b - p0)).norm() / (b - p0).norm()
        assert 0 < err < 1e-2, err
    states = list(zip(bf16.state.values(), fp32.state.values(), strict=True))
    for ours, theirs in states:
        assert ours["exp_avg"].dtype == ours["exp_avg_sq"].dtype == torch.bfloat16
        for key in ("exp_avg", "exp_avg_sq"):  # norm-wise: exp_avg crosses zero, where a relative error means nothing
            err = (ours[key].float() - theirs[key]).norm() / theirs[key].norm()
            assert err < 1e-2, (key, err)
    nbytes = [sum(state[k].nbytes for state in side for k in ("exp_avg", "exp_avg_sq")) for side in zip(*states)]
    assert nbytes[0] * 2 == nbytes[1]


def test_the_config_chooses_the_optimizer_and_rejects_what_cannot_work(tiny_run_config) -> None:
    model = torch.nn.Linear(4, 4)
    assert type(build_optimizer(model, OptimConfig())) is torch.optim.AdamW
    assert build_optimizer(model, OptimConfig(state_dtype="bfloat16")).state_dtype == torch.bfloat16
    cfg = tiny_run_config()
    for optim, message in [(dict(state_dtype="bf16"), "optim.state_dtype='bf16' is unknown"),
                           (dict(state_dtype="bfloat16", fused=True), "optim.fused=True picks torch's AdamW"),
                           (dict(state_dtype="bfloat16", betas=(0.9, 0.999)), r"optim.betas=\[0.9, 0.999\] move")]:
        with pytest.raises(ValueError, match=message):
            validate(dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, **optim)))


def test_bfloat16_state_resumes_exactly_and_a_float32_checkpoint_converts_when_allowed(tiny_run_config,
                                                                                       tmp_path) -> None:
    bf16 = "optim.state_dtype=bfloat16"
    # Step 5's loss is the first to see moments stored after the resume (a resumed run keeping fp32 ones differs).
    full = train.run(tiny_run_config("train.steps=5", bf16, f"train.output_dir={tmp_path / 'a'}"))
    train.run(tiny_run_config("train.steps=5", bf16, "checkpoint.interval=2", f"train.output_dir={tmp_path / 'b'}"))
    resumed = train.run(tiny_run_config("train.steps=5", bf16, f"train.resume={tmp_path / 'b/checkpoints/step_00000002'}",
                                        f"train.output_dir={tmp_path / 'c'}"))
    assert losses(resumed) == {s: losses(full)[s] for s in (3, 4, 5)}  # bit for bit

    train.run(tiny_run_config("train.steps=4", "checkpoint.interval=2", f"train.output_dir={tmp_path / 'd'}"))
    fp32_ckpt = tmp_path / "d/checkpoints/step_00000002"
    with pytest.raises(ValueError, match=r"optim.state_dtype: 'float32' -> 'bfloat16'.*allow_changes"):
        train.run(tiny_run_config("train.steps=4", bf16, f"train.resume={fp32_ckpt}",
                                  f"train.output_dir={tmp_path / 'e'}"))
    # Allowed: the moments load rounded to bf16 (DCP copies into the optimizer's own state tensors).
    cfg = tiny_run_config(bf16)
    spec, model_args = startup.resolve_model(cfg)
    moments = {}
    for name, state_dtype in (("fp32", "float32"), ("bf16", "bfloat16")):
        model = spec.model_cls(model_args)
        optimizer = build_optimizer(model, OptimConfig(state_dtype=state_dtype))
        load_checkpoint(fp32_ckpt, model, optimizer, None)
        moments[name] = [s[k] for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert moments["bf16"][0].dtype == torch.bfloat16 and moments["fp32"][0].dtype == torch.float32
    for ours, theirs in zip(moments["bf16"], moments["fp32"], strict=True):
        assert torch.equal(ours, theirs.to(torch.bfloat16))
    resumed = train.run(tiny_run_config("train.steps=4", bf16, f"train.resume={fp32_ckpt}",
                                        "train.allow_changes=[optim.state_dtype]", f"train.output_dir={tmp_path / 'f'}"))
    assert [m["step"] for m in resumed] == [3, 4]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the Triton AdamW)")
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_the_triton_update_gated_on_the_device_is_the_host_scaled_one_or_nothing(state_dtype: torch.dtype) -> None:
    """The Triton pass with a device ``gate`` [coefficient, applies]: to the bit the pass with the coefficient as a
    host float where it applies (0.5: exact in both), and no write at all where it does not."""
    from kernels.optim.triton_adamw import adamw_step

    gen = torch.Generator(device="cuda").manual_seed(0)
    n = (1 << 20) + 3  # a partial last block
    p0, g = (torch.randn(n, device="cuda", generator=gen) for _ in range(2))
    m0 = (torch.randn(n, device="cuda", generator=gen) * 1e-2).to(state_dtype)
    v0 = (torch.randn(n, device="cuda", generator=gen) * 1e-2).square().to(state_dtype)
    hyper = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=10.0)

    def run(**how):
        p, m, v, copy = p0.clone(), m0.clone(), v0.clone(), torch.zeros_like(p0, dtype=torch.bfloat16)
        adamw_step(p, g, m, v, p_copy=copy, **hyper, **how)
        return p, m, v, copy

    host = run(grad_scale=0.5)
    applied = run(gate=torch.tensor([0.5, 1.0], device="cuda"))
    refused = run(gate=torch.tensor([0.5, 0.0], device="cuda"))
    for a, b in zip(applied, host, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(refused, (p0, m0, v0, torch.zeros_like(p0, dtype=torch.bfloat16)), strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(host[0], p0)


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])  # torch's AdamW, and ours
def test_weight_decay_reaches_every_matrix_and_no_vector(state_dtype: str) -> None:
    """build_optimizer's groups, seen through a step on zero gradients (Adam's update is then 0, so a parameter moves
    by its decay alone): the embedding, the LM head, every projection, the routers and the experts' 3-D weights shrink
    by lr x weight_decay; norm weights keep their values."""
    args = debug_model_args()
    model = models.get_spec("qwen3_moe").model_cls(args)
    model.load_state_dict(seeded_weights(args))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    cfg = OptimConfig(lr=0.1, weight_decay=0.5, state_dtype=state_dtype)
    optimizer = build_optimizer(model, cfg)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    clipped_step(optimizer, model, 0.0, 0.0)
    decayed = {name for name, p in model.named_parameters() if not torch.equal(p.detach(), before[name])}
    matrices = {name for name, p in before.items() if p.ndim >= 2}
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.gate_up_proj"} <= matrices
    assert decayed == matrices and all(before[name].ndim == 1 for name in set(before) - matrices)
    for name in matrices:
        torch.testing.assert_close(model.get_parameter(name).detach(), before[name] * (1 - cfg.lr * cfg.weight_decay))


@pytest.mark.parametrize("kind, path", [("torch", "clipped_step"), ("float32", "clipped_step"),
                                        ("bfloat16", "clipped_step"), ("float32", "queue_step"),
                                        ("bfloat16", "queue_step")])  # torch's AdamW steps after the read only
def test_a_gradient_within_the_clip_trains_as_with_clipping_off(kind: str, path: str) -> None:
    """Clipping only ever scales down: a step whose norm is below optim.grad_clip is the step without clipping, to
    the bit (every test elsewhere clips a norm above it). The coefficient itself: min(max_norm / norm, 1)."""
    assert clip_coefficient(1.0, 0.25) == 1.0 and clip_coefficient(1.0, torch.tensor(0.25)).item() == 1.0
    runs = []
    for max_norm in (100.0, 0.0):  # gradients of norm 5 to 12; 0: not clipped
        init, grads = _problem()
        params = [torch.nn.Parameter(p.clone()) for p in init]
        model = torch.nn.ParameterList(params)
        optimizer = (torch.optim.AdamW(params, **HYPER) if kind == "torch"
                     else AdamW([{"params": params}], **HYPER, state_dtype=getattr(torch, kind)))
        for step_grads in grads[:3]:
            for p, grad in zip(params, step_grads):
                p.grad = grad.clone()
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in step_grads]))
            if path == "queue_step":
                queue_step(optimizer, max_norm, norm, torch.ones(3))
            else:
                clipped_step(optimizer, model, max_norm, norm.item())
        runs.append([p.detach() for p in params])
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)
