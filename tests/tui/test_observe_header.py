"""The header of an own loop: its epoch is shown once the observer has seen one end."""

import re

from conftest import text, until

EPOCHS = """
import time, torch
from torch import nn
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randint(2, (32,))),
                                     batch_size=16)
for epoch in range(1000):
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
        time.sleep(0.01)
"""


async def test_own_loop_header_shows_the_epoch_once_known(own_loop_app):
    app = own_loop_app(EPOCHS)
    async with app.run_test(size=(110, 32)) as pilot:
        await until(pilot, lambda: app.view.latest is not None and app.view.latest.epoch >= 2)
        shown = re.search(r"epoch (\d+)", text(app, "#header"))  # counted from 1, as fit's
        assert shown and int(shown.group(1)) >= 3, text(app, "#header")
