"""The gradient hand-off's cast (``cast_gradient``): a bf16 gradient to the fp32 reduce dtype, in the parameter's
layout, divided by the gradient divide factor: what FSDP's reduce-scatter does to a gradient on a mesh of one rank
(``parallelisms/compute_copy.py``), once per parameter per backward.

``cast_gradient`` runs the kernel ``kernels/registry.py`` chose for the device (installed in ``kernels.installed``):
``kernels.optim.triton_cast`` on CUDA (torch's dtype-converting copy takes its non-vectorised path there, about half the
memory bandwidth); the reference, ``cast_gradient_torch``, everywhere else.
"""

from __future__ import annotations

import torch

from kernels.installed import kernel


def cast_gradient(g: torch.Tensor, dtype: torch.dtype, stride: tuple[int, ...], divide_by: float) -> torch.Tensor:
    """A new tensor of ``g``'s shape with ``stride``, in ``dtype``: ``g`` converted, then divided by ``divide_by``
    (skipped when 1)."""
    return kernel("cast_gradient", g, cast_gradient_torch)(g, dtype, stride, divide_by)


def cast_gradient_torch(g: torch.Tensor, dtype: torch.dtype, stride: tuple[int, ...], divide_by: float
                        ) -> torch.Tensor:
    """The reference: one copy (conversion and layout together), then the division in the new dtype."""
    out = torch.empty_strided(g.shape, stride, dtype=dtype, device=g.device).copy_(g)
    return out.div_(divide_by) if divide_by != 1 else out
