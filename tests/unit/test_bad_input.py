import pytest
import torch
from helpers import ConvNet, conv_batches, conv_step
from torch import nn

import gputui


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize(
    "step, message",
    [
        (
            lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1], reduction="none"),
            r"step\(\) must return a scalar loss \(the mean over the batch\), got a tensor of shape \(4,\)",
        ),
        (lambda m, b: 0.5, r"step\(\) must return the loss as a scalar tensor, got float"),
        (lambda m, b: conv_step(m, b).detach(), "does not require grad"),
    ],
)
def test_bad_step_output(step, message, hub):
    model = ConvNet()
    with pytest.raises(gputui.FitError, match=message):
        gputui.fit(model, conv_batches(2, 4), step, sgd(model))
    assert [e.name for e in hub.events()][-2:] == ["error", "part_ended"]
    hub.finish()  # the script ends: the run's end record says why it failed
    assert hub.summary.error and hub.summary.steps == 0


def test_a_script_that_exits_from_its_step_stopped_and_a_keyboard_interrupt_failed(hub):
    """sys.exit(0) inside step() ends the run as stopped, not failed (the summary said "failed" with exit 0);
    a KeyboardInterrupt out of a step stays the run's error, so a notebook's next fit() still trains."""
    model = ConvNet()

    def ending(when, exc):
        def step(model, batch):
            step.n += 1
            if step.n == when:
                raise exc
            return conv_step(model, batch)

        step.n = 0
        return step

    with pytest.raises(KeyboardInterrupt):
        gputui.fit(model, conv_batches(4, 4), ending(2, KeyboardInterrupt()), sgd(model))
    after = gputui.fit(model, conv_batches(2, 4), conv_step, sgd(model))
    assert after.steps == 2 and after.stopped is None  # it trained: no stop held from the interrupt
    with pytest.raises(SystemExit):
        gputui.fit(model, conv_batches(4, 4), ending(3, SystemExit(0)), sgd(model))
    hub.finish()
    assert hub.summary.stopped == "exited" and hub.summary.error is None


def test_empty_data_and_one_shot_generators():
    model = ConvNet()
    with pytest.raises(gputui.FitError, match="data yielded no batches: nothing to train on"):
        gputui.fit(model, [], conv_step, sgd(model))
    calls = []

    def counted(model, batch):
        calls.append(1)
        return conv_step(model, batch)

    with pytest.raises(gputui.FitError, match=r"epochs=2, but data is an iterator \(generator\): it can be iterated"):
        gputui.fit(model, (b for b in conv_batches(2, 4)), counted, sgd(model), epochs=2)
    assert not calls  # said before an epoch is trained (and the script's save after fit lost)
    with pytest.raises(gputui.FitError, match="in epoch 2: it can be iterated only once"):  # max_steps past its end
        gputui.fit(model, (b for b in conv_batches(2, 4)), conv_step, sgd(model), max_steps=3)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(memory_budget="lots"), ValueError, "not a size: 'lots'"),
        (dict(amp="fp8"), ValueError, "unknown AMP mode 'fp8'"),
        (dict(micro_batch=0), ValueError, "micro_batch must be a positive int"),
        (dict(epochs=1.5), ValueError, "epochs must be a positive int"),
        (dict(device="cuda"), ValueError, "CUDA is not available"),
        (dict(device="meta"), ValueError, "device='meta' is not one gputui trains on: cuda, mps or cpu"),
        (dict(device="tpu"), RuntimeError, "tpu"),
        (dict(auto_recover=0), TypeError, "auto_recover must be True or False, got 0"),
        (dict(checkpointing=1), TypeError, "checkpointing must be True or False or None, got 1"),
    ],
)
def test_bad_arguments(kwargs, error, message):
    model = ConvNet()
    with pytest.raises(error, match=message):
        gputui.fit(model, conv_batches(1, 2), conv_step, sgd(model), **kwargs)


def test_an_optimizer_of_another_model_and_a_scheduler_that_needs_a_metric_are_refused_up_front():
    """Either trained nothing (the optimizer) or failed after the first optimizer.step() (the scheduler)."""
    model = ConvNet()
    stale = sgd(ConvNet())  # made before the model was rebuilt
    with pytest.raises(ValueError, match="the optimizer holds none of the model's 16 trainable parameters"):
        gputui.fit(model, conv_batches(1, 2), conv_step, stale)
    with pytest.raises(ValueError, match="the optimizer holds none"):
        gputui.Trainer(model, stale, conv_step)
    optimizer = sgd(model)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
    with pytest.raises(ValueError, match=r"scheduler=ReduceLROnPlateau steps on a value \(metrics\)"):
        gputui.fit(model, conv_batches(1, 2), conv_step, optimizer, scheduler=plateau)
    with pytest.raises(TypeError, match="scheduler must have a step"):
        gputui.Trainer(model, optimizer, conv_step, scheduler=0.5)
    before = [p.detach().clone() for p in model.parameters()]
    gputui.fit(model, conv_batches(1, 2), conv_step, optimizer, scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 1))
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))  # a plain one trains


def test_checkpointing_without_blocks_is_refused_up_front():
    model = nn.Sequential(nn.Flatten(), nn.Linear(108, 5))
    with pytest.raises(ValueError, match="checkpointing=True, but no repeated blocks found"):
        gputui.fit(model, conv_batches(1, 2), conv_step, sgd(model), checkpointing=True)


def test_wrong_types():
    model = ConvNet()
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        gputui.fit(lambda x: x, conv_batches(1, 2), conv_step, sgd(model))
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        gputui.fit(model, conv_batches(1, 2), conv_step, "adam")
    with pytest.raises(TypeError, match="data must be an iterable"):
        gputui.fit(model, 3, conv_step, sgd(model))
    with pytest.raises(ValueError, match="a batch must hold at least one tensor"):
        gputui.fit(model, [{"text": "no tensors"}], conv_step, sgd(model))

    class Custom:  # a class of the script's own, tensors inside: what gputui walks is said
        def __init__(self):
            self.x = torch.ones(2, 3, 8, 8)

    with pytest.raises(ValueError, match="in a tuple, list, dict, dataclass or namedtuple .*; got Custom"):
        gputui.fit(model, [Custom()], conv_step, sgd(model))


def test_a_rejected_call_leaves_no_hook_behind():
    model = ConvNet()
    with pytest.raises(ValueError):
        gputui.fit(model, conv_batches(1, 2), conv_step, sgd(model), memory_budget="1KiB", amp="fp8")
    # a stale budget hook would raise OutOfMemoryError here
    conv_step(model, conv_batches(1, 2)[0]).backward()
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
