"""rayft: LoRA + FSDP2 fine-tuning of large causal LMs on Ray Train."""

__version__ = "0.1.0"
