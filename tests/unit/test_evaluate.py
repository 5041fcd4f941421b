"""gputui.evaluate(): the mean over the data a plain loop takes (by samples or by items), whatever the
micro-batch and the OOMs on the way, in eval mode and back, published into the run's hub."""

import json

import pytest
import torch
from helpers import ConvNet, TokenModel, conv_batches, conv_step, count_tokens, padded_batches, padded_step
from torch import nn
from torch.nn import functional as F

import gputui
from gputui.telemetry import hub as hubs
from gputui.telemetry.checks import checked
from gputui.telemetry.jsonl import MetricsFile
from gputui.telemetry.protocol import ProtocolError, encode, parse_server


def token_mean(model, batches) -> float:
    """The plain loop: one cross-entropy over every token that counts in all the batches."""
    with torch.no_grad():
        logits = torch.cat([model(b["input_ids"]).flatten(0, 1) for b in batches])
        labels = torch.cat([b["labels"].flatten() for b in batches])
        return F.cross_entropy(logits, labels, ignore_index=-100).item()


def sample_mean(model, batches) -> float:
    with torch.no_grad():
        return F.cross_entropy(torch.cat([model(x) for x, _ in batches]), torch.cat([y for _, y in batches])).item()


def model_and_batches():
    torch.manual_seed(0)
    return TokenModel(), padded_batches(3, 8)


@pytest.mark.parametrize("micro_batch", [None, 2, 3])
def test_with_items_it_is_the_token_mean_at_any_micro_batch(micro_batch):
    model, batches = model_and_batches()
    value = gputui.evaluate(model, batches, padded_step, items=count_tokens, micro_batch=micro_batch)
    assert value == pytest.approx(token_mean(model, batches), rel=1e-6)


def test_without_items_it_is_the_sample_mean_over_batches_of_different_sizes():
    torch.manual_seed(0)
    model = ConvNet()
    batches = [*conv_batches(2, 8), *conv_batches(1, 3, seed=1)]  # a short last batch weighs less
    for micro_batch in (None, 2):
        value = gputui.evaluate(model, batches, conv_step, micro_batch=micro_batch)
        assert value == pytest.approx(sample_mean(model, batches), rel=1e-6)


def position_mean(model, batch):
    """The tokens' mean position: high in the long sequence, low in the short ones (an untrained
    model's loss is near log(20) on every token, which no weighting tells apart)."""
    counted = batch["labels"] != -100
    return torch.arange(counted.shape[1]).expand_as(counted)[counted].float().mean()


def test_the_items_weights_matter():
    """The data discriminates: pieces weighted by their samples are far from the token mean."""
    _, batches = model_and_batches()
    labels = torch.cat([b["labels"] for b in batches])  # the plain token mean: every batch as one
    expected = position_mean(None, {"labels": labels}).item()
    by_items = gputui.evaluate(nn.Linear(1, 1), batches, position_mean, items=count_tokens, micro_batch=2)
    by_samples = gputui.evaluate(nn.Linear(1, 1), batches, position_mean, micro_batch=2)
    assert by_items == pytest.approx(expected, rel=1e-6)
    assert abs(by_samples - expected) > 0.3


class Recorder(nn.Module):
    """Dropout and BatchNorm say whether eval mode and no_grad were on."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 1)
        self.frozen = nn.BatchNorm1d(4)
        self.seen = []

    def forward(self, x):
        self.seen.append((self.training, torch.is_grad_enabled()))
        return self.linear(x)


def linear_step(model, batch):
    return model(batch).mean()


def test_eval_mode_and_no_grad_inside_and_each_module_s_mode_restored_after():
    model = Recorder()
    model.frozen.eval()  # a layer the script froze stays frozen
    gputui.evaluate(model, [torch.ones(4, 4)], linear_step)
    assert model.seen == [(False, False)]
    assert model.training and model.linear.training and not model.frozen.training
    model.eval()
    gputui.evaluate(model, [torch.ones(4, 4)], linear_step)
    assert not model.training and not model.linear.training


def test_train_mode_is_restored_when_fn_raises():
    model = Recorder()

    def broken(model, batch):
        raise KeyError("labels")

    with pytest.raises(KeyError):
        gputui.evaluate(model, [torch.ones(4, 4)], broken)
    assert model.training and model.frozen.training


class OomAbove:
    """fn that runs out of memory on a piece of more than `limit` samples, as a small GPU would."""

    def __init__(self, limit):
        self.limit, self.sizes = limit, []

    def __call__(self, model, batch):
        self.sizes.append(len(batch["input_ids"]))
        if len(batch["input_ids"]) > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return padded_step(model, batch)


def test_an_oom_replays_the_batch_at_half_the_micro_batch_and_the_value_is_exact(hub):
    model, batches = model_and_batches()
    fn = OomAbove(2)
    value = gputui.evaluate(model, batches, fn, items=count_tokens, micro_batch=8)
    assert value == pytest.approx(token_mean(model, batches), rel=1e-6)
    assert fn.sizes[:4] == [8, 4, 2, 2]  # 8 and 4 fail; the batch replays whole at 2 (no piece counted twice)
    assert set(fn.sizes[4:]) == {2}  # the later batches start at the halved micro-batch
    (event,) = [e for e in hub.events() if e.name == "eval"]
    assert event["ooms"] == 2 and event["micro_batch"] == 2


def test_an_oom_at_micro_batch_1_is_a_clear_error():
    model, batches = model_and_batches()
    with pytest.raises(gputui.FitError, match="out of memory in evaluate\\(\\) at micro-batch 1: not even one"):
        gputui.evaluate(model, batches, OomAbove(0), items=count_tokens)
    assert model.training


def test_the_result_is_published_at_the_run_s_step_and_written_to_the_metrics_file(hub, tmp_path):
    metrics = MetricsFile(tmp_path / "m.jsonl")
    hub.add_sink(metrics)
    model, batches = model_and_batches()
    gputui.fit(model, batches, padded_step, torch.optim.SGD(model.parameters(), lr=0.1), items=count_tokens)
    value = gputui.evaluate(model, batches[:2], padded_step, items=count_tokens, micro_batch=4)
    metrics.close()

    (event,) = [e for e in hub.events() if e.name == "eval"]
    assert event.step == 3 == hub.last_step()
    tokens = sum(int(count_tokens(b)) for b in batches[:2])
    assert event.details | {"seconds": 0} == {
        "value": value,
        "batches": 2,
        "samples": 16,
        "items": tokens,
        "seconds": 0,
        "micro_batch": 4,
        "ooms": 0,
    }
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r for r in lines if r.get("name") == "eval"][0]["value"] == value


def test_an_attach_client_accepts_the_event_and_refuses_a_broken_one(hub):
    model, batches = model_and_batches()
    gputui.evaluate(model, batches, padded_step)
    (event,) = [e for e in hub.events() if e.name == "eval"]
    record = checked(parse_server(encode(event.to_json())))
    assert record["value"] == event["value"] and record["items"] is None
    with pytest.raises(ProtocolError, match="cannot describe"):
        checked(parse_server(encode({**event.to_json(), "seconds": "soon"})))


def test_with_no_hub_nothing_is_published_and_none_is_made():
    hubs.install(None)
    model, batches = model_and_batches()
    gputui.evaluate(model, batches, padded_step)
    assert hubs.current() is None


def autocast_dtype(seen):
    def fn(model, batch):
        seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
        return padded_step(model, batch)

    return fn


def test_amp_follows_the_run_unless_given():
    model, batches = model_and_batches()
    seen = []
    gputui.evaluate(model, batches[:1], autocast_dtype(seen))  # no step published yet: off
    gputui.fit(model, batches[:1], padded_step, torch.optim.SGD(model.parameters(), lr=0.1), amp="bf16")
    gputui.evaluate(model, batches[:1], autocast_dtype(seen))
    gputui.evaluate(model, batches[:1], autocast_dtype(seen), amp="off")
    assert seen == [None, torch.bfloat16, None]


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda m, b: gputui.evaluate(m, b, "padded_step"), TypeError, "fn must be a function"),
        (lambda m, b: gputui.evaluate(m, 3, padded_step), TypeError, "data must be an iterable of batches, got int"),
        (lambda m, b: gputui.evaluate(m, [], padded_step), gputui.FitError, "data yielded no batches"),
        (lambda m, b: gputui.evaluate(m, b, lambda m, x: m(x["input_ids"])), gputui.FitError, "got a tensor of shape"),
        (lambda m, b: gputui.evaluate(m, b, lambda m, x: 1.5), gputui.FitError, "got float"),
        (lambda m, b: gputui.evaluate(m, b, padded_step, micro_batch=0), ValueError, "micro_batch must be a positive"),
        (lambda m, b: gputui.evaluate(m, b, padded_step, amp="fp8"), ValueError, "unknown AMP mode 'fp8'"),
        (lambda m, b: gputui.evaluate(m, b, padded_step, items=lambda b: -1), gputui.FitError, "must return a count"),
        (lambda m, b: gputui.evaluate(m, b, padded_step, items=lambda b: 0), gputui.FitError, "counted nothing"),
    ],
)
def test_bad_input_is_one_clear_line(call, error, message):
    model, batches = model_and_batches()
    with pytest.raises(error, match=message) as caught:
        call(model, batches)
    assert "\n" not in str(caught.value)
    assert model.training
