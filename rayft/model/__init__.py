"""Model: build on meta, LoRA targets, FSDP2 and precision, sharded weight loading, the fused loss."""
