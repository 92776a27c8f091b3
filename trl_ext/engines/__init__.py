"""How the training runs: hardware fixes, DeepSpeed and FSDP2, several nodes, gradient checkpointing, quantization,
rank-0 loading."""
