"""How the training runs: hardware fixes, DeepSpeed and FSDP2, elastic resume, several nodes, the checkpointing
policy, quantization."""
