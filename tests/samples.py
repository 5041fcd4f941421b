"""A step's record for tests: every field StepSample requires at a plain value, the ones a test is about
named. The one place a test changes when StepSample gains a field."""

from gputui.telemetry.sample import Memory, StepSample


def step_sample(step: int = 1, **fields) -> StepSample:
    """Step `step` of a CPU run at batch 8 in one piece (accumulation follows the batch and micro-batch
    given), published at 1000 + step; any other field as named."""
    batch = fields.pop("batch_size", 8)
    micro = fields.pop("micro_batch", batch)
    plain = {
        "t": 1000.0 + step,
        "epoch": 0,
        "loss": 1.0,
        "accumulation": batch // micro,
        "amp": "off",
        "checkpointing": False,
        "samples_per_s": None,
        "memory": Memory("cpu"),
    }
    return StepSample(step=step, batch_size=batch, micro_batch=micro, **{**plain, **fields})
