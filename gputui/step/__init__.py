"""What one step is, real or traced: how a global batch is cut and sized (microbatch, sizing),
its precision and its checkpointing. The engine runs it on real tensors, the planner on fake
ones; this package imports neither."""
