"""The command palette's provider: every key's action, searchable, with why it cannot act when it cannot
(the rows are the app's `palette()`, from the key table; a pick runs the app's `act`, as the key would)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Protocol, cast

from textual.command import DiscoveryHit, Hit, Hits, Provider

from .keys import Key


class PaletteApp(Protocol):
    def palette(self) -> list[tuple[Key, str, str]]: ...

    act: Callable[[str], Awaitable[None]]


class Actions(Provider):
    def _app(self) -> PaletteApp:
        return cast(PaletteApp, self.app)  # listed only in GputuiApp.COMMANDS

    async def discover(self) -> Hits:
        app = self._app()
        for key, name, help in app.palette():
            yield DiscoveryHit(name, partial(app.act, key.action), help=help)

    async def search(self, query: str) -> Hits:
        app = self._app()
        matcher = self.matcher(query)
        for key, name, help in app.palette():
            score = matcher.match(name)
            if score > 0:
                yield Hit(score, matcher.highlight(name), partial(app.act, key.action), help=help)
