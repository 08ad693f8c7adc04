"""What stands in for a collective's time on the links in the loopback world (``parallelisms/loopback.py``,
``launch.links.emulate``): ``link`` (the clock a collective starts at and the hold until its link time has passed; on
the CPU the caller's clock and a sleep), beside ``triton_link`` (a kernel on as many SMs as NCCL's channels, spinning
on the GPU's global timer)."""
