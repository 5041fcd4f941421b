import pytest

from gputui.telemetry.lossparse import LossParser, loss_in


@pytest.mark.parametrize("line, value, style", [
    ("100%|██████████| 50/50 [00:02<00:00, 21.3it/s, loss=0.693]", 0.693, "printed (tqdm)"),
    (" 40%|████      | 40/100 [00:01<00:02, 30.00it/s, loss=1.23e-02, lr=3e-4]", 0.0123, "printed (tqdm)"),
    ("Epoch 0:  40%|████      | 40/100 [00:01<00:02, 30.00it/s, v_num=0, train_loss=0.693]", 0.693,
     "printed (Lightning)"),
    ("{'loss': 0.6931, 'grad_norm': 1.24, 'learning_rate': 5e-05, 'epoch': 0.5}", 0.6931,
     "printed (Hugging Face Trainer)"),
    ("step 42 loss: 0.693", 0.693, "printed"),
    ("iter 42: loss 0.693", 0.693, "printed"),
    ("epoch 3 | batch 120/500 | lr 0.001 | loss 0.69 | 512 tok/s", 0.69, "printed"),
    ("Train Loss: 2.5", 2.5, "printed"),
    ("step 7 train/loss=3.25", 3.25, "printed"),
    ("loss=nan", float("nan"), "printed"),
])
def test_the_formats_people_print(line, value, style):
    found = loss_in(line)
    assert found is not None
    got, got_style = found
    assert (got == pytest.approx(value) or (got != got and value != value)) and got_style == style


@pytest.mark.parametrize("line", [
    "val_loss=0.5", "eval_loss: 0.5", "{'eval_loss': 0.41, 'epoch': 1.0}", "test loss 0.3", "validation loss: 0.2",
    "lossless compression", "no numbers here", "closs=3", "loss_scale=65536.0",
])
def test_not_a_training_loss(line):
    assert loss_in(line) is None


def test_parser_splits_on_carriage_returns_and_newlines():
    seen = []
    parser = LossParser(lambda value, style: seen.append(value))
    for piece in ["\r 10%|█ | 1/10 [00:00, loss=2.5", "0]\r 20%|██ | 2/10 [00:00, loss=2.",
                  "25]", "\nstep 3 loss: 2.0\n", "partial loss=1.0"]:
        parser.feed(piece)
    assert seen == [2.5, 2.25, 2.0]
