"""gputui.Trainer: the script's own loop with gputui's step. It trains as a plain full-batch loop would
(token-weighted micro-batches, OOM replay), resumes from its state_dict() as if never stopped, and says
when a stop was asked for so the loop can leave."""

import contextlib
import copy
import gc
import sys
import weakref

import pytest
import torch
from helpers import (
    ConvNet,
    RequestAt,
    TokenModel,
    assert_same_buffers,
    assert_same_tensors,
    assert_same_weights,
    conv_batches,
    conv_step,
    count_tokens,
    halving_only,
    own_process,
    padded_batches,
    padded_step,
    plain_loop,
)

import gputui
from gputui.engine import deferred
from gputui.engine.trainer import STATE_VERSION

GOOD_STATE = {
    "version": STATE_VERSION,
    "steps": 3,
    "samples": 24,
    "micro_batch": None,
    "amp": "off",
    "checkpointing": False,
    "auto_recover": True,
    "scaler": None,
    "planner": None,
}
BUDGET = "64KiB"  # a whole batch of 8 does not fit (with the momentum buffers): step 1 halves it to 4


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)  # momentum: optimizer state to resume


def recording(step, losses):
    """`step`, keeping each loss it returns (the plain loop's, one per global batch)."""

    def record(model, batch):
        loss = step(model, batch)
        losses.append(float(loss.detach()))
        return loss

    return record


def plain(batches):
    """The reference: a plain full-batch loop's weights and losses."""
    torch.manual_seed(0)
    model, losses = TokenModel(), []
    plain_loop(model, batches, recording(padded_step, losses), sgd)
    return model, losses


def train(model, batches, **options):
    opt = sgd(model)
    with gputui.Trainer(model, opt, padded_step, items=count_tokens, **options) as trainer:
        return [trainer.step(batch) for batch in batches]


@pytest.mark.parametrize(
    "options",
    [{"micro_batch": 2}, {"memory_budget": BUDGET}],
    ids=["micro_batch", "budget_ooms"],
)
def test_an_own_loop_trains_to_the_plain_full_batch_loop(options, monkeypatch):
    halving_only(monkeypatch)
    batches = padded_batches(4, 8, seed=2)
    ref, losses = plain(batches)
    torch.manual_seed(0)
    model = TokenModel()
    results = train(model, batches, **options)
    assert_same_weights(model, ref)
    # read after the loop: each result keeps its own step's loss, not the last one's
    assert [r.loss for r in results] == pytest.approx(losses, rel=1e-5)
    assert [r.steps for r in results] == [1, 2, 3, 4]
    assert all(r.trained and r.stopped is None for r in results)
    ooms = [r.ooms_recovered for r in results]
    if "memory_budget" in options:
        assert ooms == [1, 0, 0, 0], "the budget must force an OOM for this test to mean anything"
        assert [r.micro_batch for r in results] == [4, 4, 4, 4]
    else:
        assert ooms == [0, 0, 0, 0] and [r.micro_batch for r in results] == [2, 2, 2, 2]


def test_the_loss_is_read_when_asked_a_float_equal_to_the_plain_loops():
    batches = padded_batches(2, 4)
    _, losses = plain(batches)
    torch.manual_seed(0)
    model = TokenModel()
    with gputui.Trainer(model, sgd(model), padded_step, micro_batch=2, items=count_tokens) as trainer:
        first = trainer.step(batches[0])
        assert type(first.loss) is float and first.loss == pytest.approx(losses[0], rel=1e-6)
        second = trainer.step(batches[1])
    assert second.loss == pytest.approx(losses[1], rel=1e-6) and first.loss == pytest.approx(losses[0], rel=1e-6)
    assert first.grad_norm is None  # no clip_grad_norm: no norm computed
    text = repr(second)
    assert text.startswith("StepResult(steps=2, loss=") and f"loss={second.loss}" in text and "stopped=None" in text


# -- resume -------------------------------------------------------------------------------------------


def test_three_steps_saved_and_three_resumed_equal_six_straight(hub, tmp_path, monkeypatch):
    halving_only(monkeypatch)
    batches = padded_batches(6, 8, seed=3)
    ref, losses = plain(batches)
    path = tmp_path / "checkpoint.pt"
    with own_process():  # the run that saved: another process, before this one
        torch.manual_seed(0)
        model = TokenModel()
        opt = sgd(model)
        with gputui.Trainer(model, opt, padded_step, items=count_tokens, memory_budget=BUDGET, steps=6) as t:
            first = [t.step(b) for b in batches[:3]]
            state = t.state_dict()
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "trainer": state}, path)
    assert first[0].ooms_recovered > 0 and first[-1].micro_batch == 4, "the budget must find a micro-batch"

    saved = torch.load(path, weights_only=True)
    model = TokenModel()
    model.load_state_dict(saved["model"])
    opt = sgd(model)
    opt.load_state_dict(saved["optimizer"])
    with gputui.Trainer(model, opt, padded_step, items=count_tokens, memory_budget=BUDGET, steps=6) as t:
        t.load_state_dict(saved["trainer"])
        resumed = [t.step(b) for b in batches[3:]]
    assert_same_weights(model, ref)
    assert [r.loss for r in first + resumed] == pytest.approx(losses, rel=1e-5)
    assert [r.steps for r in resumed] == [4, 5, 6]
    assert [r.micro_batch for r in resumed] == [4, 4, 4] and sum(r.ooms_recovered for r in resumed) == 0
    assert [s.step for s in hub.samples()] == [4, 5, 6]
    assert hub.info.total_steps == 6
    assert not [e for e in hub.events() if e.name in ("oom", "oom_recovered")]
    assert t.result().steps == 3 and t.result().samples == 24  # the resumed part's own figures


def test_steps_is_the_start_records_total(hub):
    model = TokenModel()
    with gputui.Trainer(model, sgd(model), padded_step, steps=6) as trainer:
        trainer.step(padded_batches(1, 4)[0])
    assert hub.info.total_steps == 6 and hub.info.model == "TokenModel"


@pytest.mark.parametrize(
    "state, message",
    [
        ([1, 2], "load_state_dict() takes what Trainer.state_dict() returned, got list"),
        ({"steps": 3, "version": STATE_VERSION + 1}, f"this state_dict is version {STATE_VERSION + 1}; gputui reads"),
        ({"steps": 3}, "this state_dict is version None; gputui reads"),
        ({"version": STATE_VERSION, "steps": 3}, "this state_dict has no 'samples'"),
        ({**GOOD_STATE, "steps": -5}, "this state_dict's 'steps' must be an int >= 0, got -5"),
        ({**GOOD_STATE, "micro_batch": 0}, "this state_dict's 'micro_batch' must be a positive int or None, got 0"),
        ({**GOOD_STATE, "amp": "bogus"}, "this state_dict's 'amp' must be one of off, bf16, fp16, got 'bogus'"),
        ({**GOOD_STATE, "auto_recover": "yes"}, "this state_dict's 'auto_recover' must be True or False"),
    ],
)
def test_a_bad_state_is_a_one_line_error(state, message):
    model = TokenModel()
    with gputui.Trainer(model, sgd(model), padded_step) as trainer:
        with pytest.raises(ValueError) as caught:
            trainer.load_state_dict(state)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


def test_a_load_after_a_step_is_a_one_line_error():
    model = TokenModel()
    with gputui.Trainer(model, sgd(model), padded_step) as trainer:
        trainer.step(padded_batches(1, 4)[0])
        state = trainer.state_dict()
        with pytest.raises(ValueError, match=r"^load_state_dict\(\) must come before the first trainer.step\(\)$"):
            trainer.load_state_dict(state)


# -- stop, close, errors ------------------------------------------------------------------------------


def test_a_stop_asked_during_a_step_is_said_by_its_result_and_the_next_step_refuses(hub):
    batches = padded_batches(3, 4)
    hub.add_sink(RequestAt(hub, 2, "stop"))  # asked as step 2 publishes: during step 2
    model = TokenModel()
    with gputui.Trainer(model, sgd(model), padded_step) as trainer:
        first, second = trainer.step(batches[0]), trainer.step(batches[1])
        assert first.stopped is None and second.stopped == "requested"
        assert second.trained and second.steps == 2 and second.loss is not None
        before = copy.deepcopy(model.state_dict())
        with pytest.raises(gputui.FitError, match=r"asked to stop \(requested\).*leave the loop"):
            trainer.step(batches[2])
    assert_same_tensors(model.state_dict(), before, atol=0, rtol=0)
    assert [s.step for s in hub.samples()] == [1, 2]
    assert [e.name for e in hub.events()].count("stopped") == 1


def test_a_stop_queued_before_a_step_leaves_it_untrained(hub):
    batches = padded_batches(2, 4)
    model = TokenModel()
    with gputui.Trainer(model, sgd(model), padded_step) as trainer:
        trainer.step(batches[0])
        before = copy.deepcopy(model.state_dict())
        hub.controls.request("stop")
        result = trainer.step(batches[1])
    assert result.trained is False and result.stopped == "requested" and result.loss is None
    assert result.steps == 1
    assert_same_tensors(model.state_dict(), before, atol=0, rtol=0)
    assert [s.step for s in hub.samples()] == [1]


def test_a_step_after_the_block_is_an_error():
    model = TokenModel()
    batch = padded_batches(1, 4)[0]
    with gputui.Trainer(model, sgd(model), padded_step) as trainer:
        trainer.step(batch)
    with pytest.raises(gputui.FitError, match="after the trainer was closed"):
        trainer.step(batch)
    closed = gputui.Trainer(model, sgd(model), padded_step)
    closed.close()
    with pytest.raises(gputui.FitError, match="after the trainer was closed"):
        closed.step(batch)


def test_an_error_in_the_block_ends_the_run_with_an_error_and_propagates(hub):
    model = TokenModel()
    with pytest.raises(RuntimeError, match="evaluation broke"):
        with gputui.Trainer(model, sgd(model), padded_step) as trainer:
            trainer.step(padded_batches(1, 4)[0])
            raise RuntimeError("evaluation broke")
    errors = [e for e in hub.events() if e.name == "error"]
    assert [e["message"] for e in errors] == ["RuntimeError: evaluation broke"]
    assert hub.summary is None  # the process's run ends with the script
    hub.finish()
    assert hub.summary.error == "RuntimeError: evaluation broke" and hub.summary.steps == 1


def test_a_trainer_never_closed_ends_its_part_when_the_script_does(hub):
    """No `with`, no close(): the script's end still ends the trainer's part before the run's end record
    (the summary, the metrics file's last lines), and a trainer the script dropped is not kept alive."""
    model = TokenModel()
    dropped = gputui.Trainer(model, sgd(model), padded_step)
    dropped.step(padded_batches(1, 4)[0])
    dropped.close()
    gone = weakref.ref(dropped)
    del dropped
    gc.collect()
    assert gone() is None
    trainer = gputui.Trainer(model, sgd(model), padded_step)
    for batch in padded_batches(2, 4):
        trainer.step(batch)
    assert [e.name for e in hub.events()].count("part_ended") == 1  # the closed one's
    hub.finish()
    assert [e.name for e in hub.events()].count("part_ended") == 2 and hub.summary.steps == 3
    with pytest.raises(gputui.FitError, match="after the trainer was closed"):
        trainer.step(padded_batches(1, 4)[0])


def test_a_step_and_optimizer_swapped_are_said_so():
    """fit takes (model, data, step, optimizer); the Trainer (model, optimizer, step): a swap is one line."""
    model = TokenModel()
    with pytest.raises(TypeError, match=r"^gputui.Trainer takes \(model, optimizer, step\)"):
        gputui.Trainer(model, padded_step, sgd(model))


def test_a_step_that_raises_and_is_caught_leaves_nothing_to_the_next(hub):
    """The "skip a bad batch" loop: the raise comes in the second piece, after the first's backward and
    its BatchNorm update; the next steps train as a plain loop that never saw that batch."""
    batches = conv_batches(4, 8)
    batches[1][0][5] = float("nan")  # in the second piece of 4

    def checked(model, batch):
        if batch[0].isnan().any():
            raise ValueError("bad sample")
        return conv_step(model, batch)

    torch.manual_seed(0)
    ref = ConvNet(batch_norm=True)
    model = copy.deepcopy(ref)
    ref_opt = sgd(ref)
    for batch in [batches[0], batches[2], batches[3]]:
        for piece in zip(batch[0].split(4), batch[1].split(4), strict=True):
            (conv_step(ref, piece) / 2).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    skipped = []
    with gputui.Trainer(model, sgd(model), checked, micro_batch=4) as trainer:
        for batch in batches:
            try:
                trainer.step(batch)
            except ValueError:
                skipped.append(trainer.result().steps)
    assert skipped == [1]
    assert_same_weights(model, ref)
    assert_same_buffers(model, ref)


def test_a_step_error_stays_the_one_raised_when_the_step_cannot_be_undone(hub):
    """A device the error broke (a CUDA device-side assert) fails gputui's undo too: the script's own error
    is raised, with a note saying what could not be undone, not gputui's error in its place."""
    model = ConvNet(batch_norm=True)

    def breaking(model, batch):
        loss = conv_step(model, batch)  # activations saved for a backward that never comes
        bn = next(m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d))
        bn.running_mean.resize_(1)  # its saved copy no longer fits: putting it back fails
        raise ValueError(f"bad sample (loss {loss.item():.3f})")

    with gputui.Trainer(model, sgd(model), breaking) as trainer, pytest.raises(ValueError) as err:
        tracker = trainer._core.session.tracker
        trainer.step(conv_batches(1, 4)[0])
    assert str(err.value).startswith("bad sample")
    if sys.version_info >= (3, 11):
        (note,) = err.value.__notes__
        assert note.startswith("gputui could not undo the failed step (RuntimeError: ")
    assert tracker.activations == 0  # the undo's parts after the one that failed still ran


def test_a_failed_steps_tensors_go_with_it_not_at_a_collection(hub):
    """The error's traceback holds the step's frames, their tensors with them: no frame of gputui's may hold
    the error in turn (a cycle only the collector frees), or a script that catches it and trains on keeps the
    failed step's memory (on a GPU: an OOM at the next step). fit's end too."""
    held = []

    def failing(model, batch):
        activation = model(batch[0])
        held.append(weakref.ref(activation))
        raise ValueError("bad sample")

    model = ConvNet()
    gc.disable()
    try:
        with gputui.Trainer(model, sgd(model), failing) as trainer:
            with contextlib.suppress(ValueError):
                trainer.step(conv_batches(1, 4)[0])
            assert held[-1]() is None, "the Trainer's failed step is still held"
        with contextlib.suppress(ValueError):
            gputui.fit(model, conv_batches(1, 4), failing, sgd(model))
        assert held[-1]() is None, "fit's failed run is still held"
    finally:
        gc.enable()


def test_a_device_the_error_broke_still_ends_the_run_with_the_scripts_error(hub, monkeypatch):
    """After a CUDA device-side assert every wait on the device fails, the run's end's too (stood in for here
    by a loss reader whose wait raises): fit raises the script's error, and the run's end record says it."""

    def broken(self):
        raise RuntimeError("CUDA error: device-side assert triggered")

    monkeypatch.setattr(deferred.DeferredLoss, "last", broken)
    calls = 0

    def failing(model, batch):
        nonlocal calls
        calls += 1
        if calls == 2:
            raise ValueError("label 7 out of range")
        return conv_step(model, batch)

    model = ConvNet()
    with pytest.raises(ValueError) as err:
        gputui.fit(model, conv_batches(3, 4), failing, sgd(model))
    assert str(err.value) == "label 7 out of range"
    if sys.version_info >= (3, 11):
        (note,) = err.value.__notes__
        assert note == "gputui could not end the run cleanly (RuntimeError: CUDA error: device-side assert triggered)"
    hub.finish()
    assert hub.summary.error == "ValueError: label 7 out of range" and hub.summary.steps == 1


def test_after_an_error_in_the_optimizer_step_under_fp16_the_next_steps_train(hub):
    """The GradScaler had unscaled the failed step's gradients: it refused every later step's unscale_()."""

    class Flaky(torch.optim.SGD):
        calls = 0

        def step(self, closure=None):
            Flaky.calls += 1
            if Flaky.calls == 2:
                raise RuntimeError("a bad step")
            return super().step(closure)

    model = torch.nn.Linear(4, 1)
    results, raised = [], []
    with gputui.Trainer(model, Flaky(model.parameters(), lr=0.1), lambda m, b: m(b).pow(2).mean(), amp="fp16") as t:
        for _ in range(4):
            try:
                results.append(t.step(torch.randn(8, 4)))
            except RuntimeError as exc:
                raised.append(str(exc))
    assert raised == ["a bad step"] and [r.steps for r in results] == [1, 2, 3]
