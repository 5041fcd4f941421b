"""How a global batch is trained where: one process (single), one rank of several under DDP (ddp),
or under FSDP2 (fsdp). Each owns its collectives; the trainer only wires them."""
