"""What a module declares about its own memory and context-parallel traffic per token, for the planner
(``training/planner.py``), which adds the parts that depend on the layout (the routed experts' dispatch, FSDP).

Modules that hold a block's work declare ``saved_activations()`` (attention, DeltaNet, the MoE block without its
routed experts), and those with a sequence op ``cp_exchange(cp)``: the planner sums them over a block's modules.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerActivations:
    """Elements kept for backward per token of this rank, in the compute dtype and in fp32, without checkpointing
    and under selective checkpointing (which keeps only the outputs of matmuls, attention and all-to-alls:
    ``parallelisms.activation_checkpoint``). Counted for the device kernels: Triton norms keep their input and an
    fp32 rstd; rotary and SwiGLU kernels keep their inputs; SDPA keeps q, k, v, its output and an fp32 logsumexp;
    FLA's chunked delta rule keeps its inputs and recomputes its chunk states."""

    none: int
    none_fp32: int
    selective: int
    selective_fp32: int

    def __add__(self, other: LayerActivations) -> LayerActivations:
        return LayerActivations(self.none + other.none, self.none_fp32 + other.none_fp32,
                                self.selective + other.selective, self.selective_fp32 + other.selective_fp32)


NO_ACTIVATIONS = LayerActivations(0, 0, 0, 0)


@dataclass(frozen=True)
class SequenceExchange:
    """Elements per token of this rank that one sequence op's Ulysses all-to-alls carry (``parallelisms.
    context_parallel``): into the op (its head arguments: compute dtype, fp32) and back out."""

    into: int
    into_fp32: int
    out: int
