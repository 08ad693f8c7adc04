"""The optimizer's side: the gradient hand-off's cast to fp32 (``cast``) and the AdamW update (``adamw``), each beside
its Triton kernel (``triton_cast``, ``triton_adamw``)."""
