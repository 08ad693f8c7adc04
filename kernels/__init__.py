"""The bottom layer with ``core``: device kernels, each beside its exact torch reference (``norm``, ``swiglu``,
``rotary``, ``delta_rule``, ``linear_cross_entropy``, ``permute``, ``grouped_mm``; the device versions in
``triton_*``, ``npu*`` and ``fla``). ``registry`` chooses one implementation of every op per device type from
``kernel_config`` (``config``). Imports only ``core``; kept import-free: the models import from here."""
