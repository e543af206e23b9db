"""The process group each training worker joins, and the NCCL environment it joins with.

`fsdp.cpu_offload` keeps sharded parameters, their gradients and the optimizer on the host: gradient clipping then
all-reduces CPU tensors, which an NCCL-only group has no backend for. Such runs get a group with gloo for host
tensors and NCCL for device tensors (`cpu:gloo,cuda:nccl`, which Ray Train passes to `init_process_group`).
"""

from __future__ import annotations

from rayft.config import Config, NcclConfig

MIXED_BACKEND = "cpu:gloo,cuda:nccl"


def process_group_backend(cfg: Config, use_gpu: bool) -> str:
    """gloo on CPU; on GPUs NCCL, with gloo beside it for the host tensors of `fsdp.cpu_offload`."""
    if not use_gpu:
        return "gloo"
    return MIXED_BACKEND if cfg.fsdp.cpu_offload else "nccl"


def nccl_env(nccl: NcclConfig) -> dict[str, str]:
    """The NCCL_* variables the `nccl` section sets (those left None are not set)."""
    named = {
        "NCCL_IB_HCA": nccl.ib_hca,
        "NCCL_IB_GID_INDEX": nccl.ib_gid_index,
        "NCCL_SOCKET_IFNAME": nccl.socket_ifname,
        "NCCL_DEBUG": nccl.debug,
        "NCCL_DEBUG_SUBSYS": nccl.debug_subsys,
    }
    return {**{k: str(v) for k, v in named.items() if v is not None}, **nccl.env}


def prefix_matched_hca(nccl: NcclConfig) -> str | None:
    """A warning when `nccl.ib_hca` names adapters by prefix: NCCL then also takes every adapter whose name starts
    so, Ethernet/RoCE ports of the same driver included."""
    hca = nccl.ib_hca
    if not hca or hca.startswith(("=", "^")):
        return None
    return (
        f"nccl.ib_hca: '{hca}' is a prefix match (NCCL takes every adapter whose name starts so, Ethernet/RoCE ports "
        f"too); name the InfiniBand adapters exactly with a leading '=', e.g. '={hca}_0,{hca}_1' "
        "(`ibstat` lists them)"
    )
