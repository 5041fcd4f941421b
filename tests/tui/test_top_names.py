"""Top tensors name the parameters they hold when the model is known (fit), folded by module;
an own loop's optimizer knows no names, and the screen says so. The event stays small."""

import json

import torch
from conftest import until
from fakes import OWN_LOOP
from torch import nn

from gputui.probes import tensors
from gputui.probes.tensors import top_training_tensors
from gputui.tui.screens import TopTensorsScreen


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(16, 48)
        self.mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))


class Deep(nn.Module):
    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.head = nn.Linear(16, 3)


def trained(model: nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.Adam(model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    return optimizer


def test_names_fold_module_indices_and_follow_grads_and_optimizer_state():
    model = Deep(blocks=60)
    optimizer = trained(model)
    report = top_training_tensors(list(model.parameters()), optimizer, model)
    rows = {(tuple(r["shape"]), r["role"]): r for r in report["rows"]}
    for role in ("parameter", "gradient", "optimizer state"):
        assert rows[(64, 16), role]["names"] == ["blocks.*.mlp.*.weight"], role
    assert rows[(48, 16), "parameter"]["names"] == ["blocks.*.attn.weight"]
    assert rows[(48, 16), "parameter"]["count"] == 60
    assert len(json.dumps(report)) < 6000  # a few KB however many blocks


def test_many_names_in_one_group_are_listed_then_counted(monkeypatch):
    # No walk of the process's other tensors: tensors other tests left alive in this worker could fill
    # the top 20 rows ahead of this small group.
    monkeypatch.setattr(tensors, "_walk", lambda deadline: ([], 0, True))
    model = nn.ModuleDict({name: nn.Linear(8, 8) for name in "abcdef"})
    report = top_training_tensors(list(model.parameters()), None, model)
    weights = next(r for r in report["rows"] if r["shape"] == [8, 8] and r["role"] == "parameter")
    assert weights["names"][:3] == ["a.weight", "b.weight", "c.weight"] and weights["names"][3] == "+3 more"


def test_an_own_loop_names_nothing():
    model = Deep(blocks=2)
    optimizer = trained(model)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    report = top_training_tensors(params, optimizer, params)  # an own loop's session tracks a list
    assert report["rows"] and not any("names" in r for r in report["rows"])


async def test_the_screen_shows_the_names_of_a_fit_model(make_app, hub):
    app = make_app()
    async with app.run_test(size=(120, 30)) as pilot:
        await until(pilot, lambda: app.view.latest is not None and app.view.latest.step >= 2)
        await pilot.press("t")
        await until(pilot, lambda: app.view.top is not None)
        table = app.screen.query_one("#top-table")
        await until(pilot, lambda: table.row_count)  # filled at the next refresh
        rows = [[str(cell) for cell in table.get_row_at(i)] for i in range(table.row_count)]
        assert ["32×32", "parameter", "blocks.*.weight"] in [[r[2], r[5], r[6]] for r in rows], rows
        assert len(json.dumps(app.view.top.details)) < 6000


async def test_the_screen_says_an_own_loops_tensors_go_unnamed(own_loop_app, hub):
    app = own_loop_app(OWN_LOOP)
    async with app.run_test(size=(120, 30)) as pilot:
        await until(pilot, lambda: app.view.latest is not None and app.view.latest.step >= 2)
        await pilot.press("t")
        assert isinstance(app.screen, TopTensorsScreen)
        await until(pilot, lambda: app.view.top is not None)
        table = app.screen.query_one("#top-table")
        await until(pilot, lambda: table.row_count)  # filled at the next refresh
        assert table.row_count and all(not str(table.get_row_at(i)[6]) for i in range(table.row_count))
        assert "own loop's tensors go unnamed" in str(app.screen.query_one("#top-status").render())
