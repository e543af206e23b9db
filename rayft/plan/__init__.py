"""`rayft plan`: what a run needs per GPU (memory.py), what it moves between GPUs (comm.py) and how long a step
takes (steptime.py), from the model's structure on the meta device (structure.py)."""

from rayft.plan.memory import GIB, GPU_GIB, MemoryPlan, format_plans, plan_memory
from rayft.plan.structure import Structure, meta_structure, structure

__all__ = [
    "GIB",
    "GPU_GIB",
    "MemoryPlan",
    "Structure",
    "format_plans",
    "meta_structure",
    "plan_memory",
    "structure",
]
