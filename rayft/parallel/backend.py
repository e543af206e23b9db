"""The process group each training worker joins, and the NCCL environment it joins with.

`fsdp.cpu_offload` keeps sharded parameters, their gradients and the optimizer on the host: gradient clipping then
all-reduces CPU tensors, which an NCCL-only group has no backend for. Such runs get a group with gloo for host
tensors and NCCL for device tensors (`cpu:gloo,cuda:nccl`, which Ray Train passes to `init_process_group`).
"""

from __future__ import annotations

from dataclasses import field
from typing import TYPE_CHECKING, Annotated, ClassVar, Literal

import pydantic.dataclasses
from annotated_types import Ge

from rayft.schema import SECTION_CONFIG, Broken, Integer, Keyed, Section, Text, broken

if TYPE_CHECKING:
    from rayft.config import Config

MIXED_BACKEND = "cpu:gloo,cuda:nccl"


@pydantic.dataclasses.dataclass(config=SECTION_CONFIG)
class NcclConfig(Section):
    """The config's `nccl` section: NCCL's fabric settings, given to every training worker on a GPU cluster through
    Ray's runtime environment (so they reach workers on any Ray cluster, not only pods rendered by `rayft k8s
    render`). None leaves a variable to the pod's environment or NCCL's own detection."""

    section: ClassVar[str] = "nccl"

    # NCCL_IB_HCA: '=mlx5_0,mlx5_1' names exact adapters (':1' a port); a bare 'mlx5' is a prefix match that
    # also takes Ethernet/RoCE ports of the same driver.
    ib_hca: Text | None = None
    # NCCL_IB_GID_INDEX: RoCE fabrics need the GID of the RoCE v2 address (commonly 3); InfiniBand needs none.
    ib_gid_index: Annotated[Integer, Ge(0)] | None = None
    # NCCL_SOCKET_IFNAME: the interface for NCCL's bootstrap and socket fallback (e.g. net1, ^lo,docker).
    socket_ifname: Text | None = None
    # NCCL_DEBUG: WARN reports problems only; INFO prints per-rank set-up lines (which transport, NET/IB or
    # NET/Socket) and is worth it only while a fabric is being brought up.
    debug: Literal["VERSION", "WARN", "INFO", "TRACE"] = "WARN"
    # NCCL_DEBUG_SUBSYS with debug INFO, e.g. INIT,NET.
    debug_subsys: Text | None = None
    # Any other NCCL_* variable, e.g. NCCL_IB_QPS_PER_CONNECTION: "1".
    env: Keyed[Text] = field(default_factory=dict)

    def broken(self) -> list[Broken | None]:
        return [
            broken(f"nccl.env: '{name}' is not an NCCL variable (names start with NCCL_)", f"env.{name}")
            for name in self.env
            if not name.startswith("NCCL_")
        ]


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
