"""Sequence ops: the few ops that mix tokens across the sequence (attention's core, DeltaNet's conv and delta rule,
finding documents from position ids). A module declares them in ``sequence_ops`` (method name -> ``SequenceOp``):
what each positional argument and the result are, in terms of sequence and heads. Context parallelism
(``parallelisms/context_parallel.py``) reads only these declarations: under Ulysses it hands the method a head
shard of the whole sequence and gives back the local tokens, and needs to know nothing about the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True)
class Heads:
    """An activation with a sequence dim and a heads dim (the rest is per-head features). ``shared``: heads that
    several others share (GQA's key/value heads, DeltaNet's query/key heads); fewer of them than cp ranks are
    repeated so that every rank receives the one its heads share."""

    seq_dim: int
    head_dim: int
    shared: bool = False


@dataclass(frozen=True)
class HeadWeights:
    """A whole per-head parameter ([heads, ...] along ``dim``), e.g. the conv taps of each head's channels: each
    rank takes the slice of the heads it runs."""

    dim: int = 0
    shared: bool = False


@dataclass(frozen=True)
class WholeSequence:
    """An input the op needs for the whole sequence (e.g. position ids, for the document ids): gathered along
    ``dim`` from every rank's tokens."""

    dim: int = -1


@dataclass(frozen=True)
class Passed:
    """An input that is the same on every rank (e.g. document ids already of the whole sequence): passed as is."""


Role = Union[Heads, HeadWeights, WholeSequence, Passed, tuple]  # a tuple: one role per element of a tuple argument


@dataclass(frozen=True)
class SequenceOp:
    args: tuple[Role, ...]  # one per positional argument
    out: Heads | None  # the result's layout; None: the same on every rank (returned as is)
