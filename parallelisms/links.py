"""The links between GPUs, as the planner counts them and the loopback world emulates them: how long one collective
call holds its group's links, from the bytes it moves and where its ranks sit.

The machine: ``gpus_per_node`` GPUs per node (ranks numbered node by node), NVLink inside a node, one NIC per GPU
between nodes. A ring all-gather / reduce-scatter / all-reduce sends (P-1) / P of its data per GPU (all-reduce
twice, all-gather (P-1) inputs) at NVLink's rate when its group sits in one node, else at the NIC's (the slower link
bounds a ring). An all-to-all sends each peer its chunk: the chunks for peers in the node at the all-to-all's rate
inside a node, those for other nodes at the NIC's, both at once (the longer one is the call's time); the chunk a rank
keeps crosses no link. The all-to-all's rate inside a node is not NVLink's: NCCL's all-to-all reached 293 GB/s at
512 MB and 145 GB/s at 16 MB between two H200s (docs/results.md#other-measured-costs), and the 2 x H200 runs lost
what 130 GB/s gives (docs/scaling.md, calibration).

``training/planner.py`` times a step's collectives with these functions (balanced splits), and
``parallelisms/loopback.py`` holds each group's stream for them when ``launch.links.emulate`` is on (the real splits
of each call). Imports nothing of ours.
"""

from __future__ import annotations

from dataclasses import dataclass

GPUS_PER_NODE = 8
NVLINK_GB_S = 450.0  # per GPU and direction inside a node (H100 / H200: NVLink 4, 900 GB/s both ways)
INTERNODE_GB_S = 50.0  # per GPU and direction between nodes: one 400 Gb/s NIC per GPU
A2A_GB_S = 130.0  # NCCL's all-to-all inside a node, calibrated on 2 x H200 for the paper model (docs/scaling.md)
# The same rate fitted for the emulated links (they hold each exchange where NCCL's runs, so what the compute hides is
# not charged): one H100 simulating the 2 x H200 rows, 2026-12-07 (docs/scaling.md#calibration-at-one-rate).
A2A_GB_S_EMULATED = 160.0
# SMs a collective's kernel occupies while it runs: NCCL runs one CTA per channel, 16 to 32 channels for an
# all-to-all over NVLink on H100/H200 (its NCCL_MAX_NCHANNELS is 32; the channels an all-to-all uses depend on the
# peers and the size), and DeepEP's normal kernels take 20 to 24 SMs. 24 sits in both ranges.
COMM_SMS = 24


@dataclass
class LinkConfig:
    """``launch.links.*``: the links a loopback simulation emulates (``launch.simulate_world``)."""

    # Hold each collective's stream for its link time, in a kernel on comm_sms SMs (CPU: the caller sleeps); off: the
    # collectives are copies only, as fast as the device copies (the exact-value tests' setting)
    emulate: bool = False
    a2a_gb_s: float = A2A_GB_S  # the all-to-all inside a node, per GPU and direction
    nvlink_gb_s: float = NVLINK_GB_S  # rings (all-gather, reduce-scatter, all-reduce) inside a node
    internode_gb_s: float = INTERNODE_GB_S  # every collective's part that crosses nodes
    gpus_per_node: int = GPUS_PER_NODE
    comm_sms: int = COMM_SMS  # SMs an emulated all-to-all's kernel occupies (NCCL's channels, DeepEP's SMs)
    # SMs an emulated ring (FSDP's all-gathers and reduce-scatters, all-reduces) occupies: the same by default. The
    # calibration's fsdp2 row ran 8.8% slower with 24 than with the links off (docs/scaling.md): fewer is the lever
    ring_sms: int = COMM_SMS


def link_errors(links: LinkConfig) -> list[str]:
    """What is wrong with ``launch.links``, each the line that refuses it."""
    errors = [f"launch.links.{key}={getattr(links, key)} must be > 0 (GB/s per GPU and direction)"
              for key in ("a2a_gb_s", "nvlink_gb_s", "internode_gb_s") if not getattr(links, key) > 0]
    errors += [f"launch.links.{key}={getattr(links, key)} must be >= 1"
               for key in ("gpus_per_node", "comm_sms", "ring_sms") if getattr(links, key) < 1]
    return errors


def ring_seconds(kind: str, input_bytes: float, ranks: list[int], links: LinkConfig) -> float:
    """One ring all_gather / reduce_scatter / all_reduce of ``input_bytes`` (each rank's input) over the group of
    global ``ranks``."""
    P = len(ranks)
    if P <= 1:
        return 0.0
    sent = {"all_gather": input_bytes * (P - 1), "reduce_scatter": input_bytes * (P - 1) / P,
            "all_reduce": 2 * input_bytes * (P - 1) / P}[kind]
    one_node = len({r // links.gpus_per_node for r in ranks}) == 1
    return sent / ((links.nvlink_gb_s if one_node else links.internode_gb_s) * 1e9)


def all_to_all_seconds(bytes_to: list[float], ranks: list[int], me: int, links: LinkConfig,
                       a2a_gb_s: float | None = None) -> float:
    """One all-to-all in which group rank ``me`` sends ``bytes_to[j]`` to group rank j (global ``ranks``; what it
    keeps, ``bytes_to[me]``, crosses no link); ``a2a_gb_s``: the rate inside a node (default ``links.a2a_gb_s``)."""
    node = ranks[me] // links.gpus_per_node
    inside = sum(b for j, b in enumerate(bytes_to) if j != me and ranks[j] // links.gpus_per_node == node)
    outside = sum(b for j, b in enumerate(bytes_to) if ranks[j] // links.gpus_per_node != node)
    return max(inside / ((a2a_gb_s or links.a2a_gb_s) * 1e9), outside / (links.internode_gb_s * 1e9))
