import pytest

from gputui.telemetry.lossparse import LossParser, loss_in


@pytest.mark.parametrize(
    "line, value, style",
    [
        ("100%|██████████| 50/50 [00:02<00:00, 21.3it/s, loss=0.693]", 0.693, "printed (tqdm)"),
        (" 40%|████      | 40/100 [00:01<00:02, 30.00it/s, loss=1.23e-02, lr=3e-4]", 0.0123, "printed (tqdm)"),
        (
            "Epoch 0:  40%|████      | 40/100 [00:01<00:02, 30.00it/s, v_num=0, train_loss=0.693]",
            0.693,
            "printed (Lightning)",
        ),
        (
            "{'loss': 0.6931, 'grad_norm': 1.24, 'learning_rate': 5e-05, 'epoch': 0.5}",
            0.6931,
            "printed (Hugging Face Trainer)",
        ),
        ("step 42 loss: 0.693", 0.693, "printed"),
        ("iter 42: loss 0.693", 0.693, "printed"),
        ("epoch 3 | batch 120/500 | lr 0.001 | loss 0.69 | 512 tok/s", 0.69, "printed"),
        ("Train Loss: 2.5", 2.5, "printed"),
        ("step 7 train/loss=3.25", 3.25, "printed"),
        ("loss=nan", float("nan"), "printed"),
    ],
)
def test_the_formats_people_print(line, value, style):
    found = loss_in(line)
    assert found is not None
    got, got_style = found
    assert got == pytest.approx(value, nan_ok=True) and got_style == style


@pytest.mark.parametrize(
    "line",
    [
        "val_loss=0.5",
        "eval_loss: 0.5",
        "{'eval_loss': 0.41, 'epoch': 1.0}",
        "test loss 0.3",
        "validation loss: 0.2",
        "lossless compression",
        "no numbers here",
        "closs=3",
        "loss_scale=65536.0",
    ],
)
def test_not_a_training_loss(line):
    assert loss_in(line) is None


def test_parser_splits_on_carriage_returns_and_newlines():
    seen = []
    parser = LossParser(lambda value, style: seen.append(value))
    for piece in [
        "\r 10%|█ | 1/10 [00:00, loss=2.5",
        "0]\r 20%|██ | 2/10 [00:00, loss=2.",
        "25]",
        "\nstep 3 loss: 2.0\n",
        "partial loss=1.0",
    ]:
        parser.feed(piece)
    assert seen == [2.5, 2.25, 2.0]


@pytest.mark.parametrize(
    "line, value, style",
    [
        (
            "{'loss': '6.034', 'grad_norm': '1.241', 'learning_rate': '4.9e-05', 'epoch': '0.02'}",
            6.034,
            "printed (Hugging Face Trainer)",
        ),  # transformers 5 quotes the values
        ('{"loss": "0.25", "epoch": 1}', 0.25, "printed"),
        (
            "Epoch 1:  40%|████      | 40/100 [00:01<00:02, 30.00it/s, v_num=0, train_loss=0.693, val_loss=0.512]",
            0.693,
            "printed (Lightning)",
        ),  # the live training loss beside the last validation's
    ],
)
def test_quoted_values_and_progress_bars_beside_a_validation_loss(line, value, style):
    assert loss_in(line) == (pytest.approx(value), style)


@pytest.mark.parametrize(
    "line",
    [
        "step 0: train loss 4.8681, val loss 4.8680",  # nanoGPT's evaluation
        "step 2000: train loss 1.7592, val loss 1.9056",
        "epoch 3 | loss 0.512 | val_loss 0.601",
        "Epoch 3/10 - loss: 0.4123 - val_loss: 0.4511",
        "{'eval_loss': '0.41', 'eval_runtime': '1.2', 'epoch': '1.0'}",
    ],
)
def test_an_evaluation_report_is_not_a_training_loss(line):
    assert loss_in(line) is None
