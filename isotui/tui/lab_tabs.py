"""The lab's tabs as the experiment registry names them: every experiment whose ``lab_tab`` names
a :class:`~isotui.tui.lab_tab.LabTab` class gets a tab (in the order of the tabs' keys), a key that
shows it, its own keys, its lines in the lab's help and a result slot in the app.

Nothing here is imported with the registry: the registry and the tabs' modules load when the lab
first needs them (the app's first frame imports neither).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from isotui.tui.lab_tab import LabTab


def lab_tabs() -> list[type[LabTab]]:
    """The tab classes the registered experiments name, ordered by the key that shows each; an
    entry that names no tab, a tab of another experiment or a key already taken is a ValueError."""
    from isotui.experiments import registry
    from isotui.tui.lab_tab import LabTab

    tabs: dict[str, type[LabTab]] = {}
    for experiment in registry.REGISTRY:
        if experiment.lab_tab is None:
            continue
        name = experiment.name
        module, _, attr = experiment.lab_tab.partition(":")
        tab = getattr(import_module(module), attr, None)
        if not (isinstance(tab, type) and issubclass(tab, LabTab)):
            raise ValueError(f"experiment {name}: lab_tab {experiment.lab_tab!r} is not a LabTab class")
        if name != tab.KIND:
            raise ValueError(f"experiment {name}: its lab tab {attr} is the tab of {tab.KIND!r}")
        if tab.KEY in tabs:
            raise ValueError(f"experiment {name}: its lab tab's key {tab.KEY!r} shows {tabs[tab.KEY].KIND}")
        tabs[tab.KEY] = tab
    return [tabs[key] for key in sorted(tabs)]


def tab_of(kind: str) -> type[LabTab] | None:
    """The tab of experiment ``kind`` (None: it has none)."""
    return next((tab for tab in lab_tabs() if kind == tab.KIND), None)


def widget_key_rows(tabs: list[type[LabTab]]) -> list[tuple[str, str]]:
    """The keys the tabs' widgets handle, for the lab's help: one row per key, each tab's use of
    it named by the tab's title (``↑ ↓``: "Heads: ...; Drift block: ...")."""
    rows: dict[str, list[str]] = {}
    for tab in tabs:
        for key, what in tab.WIDGET_KEYS:
            rows.setdefault(key, []).append(f"{tab.TITLE}: {what}")
    return [(key, "; ".join(uses)) for key, uses in rows.items()]


class LabResults(dict[str, Any]):
    """The app's lab results, by experiment: a tab's slot is made on first use, holding what its
    tab keeps before anything has run (:meth:`LabTab.no_result`); an experiment with no tab has none
    (KeyError)."""

    def __missing__(self, kind: str) -> Any:
        tab = tab_of(kind)
        if tab is None:
            raise KeyError(kind)
        self[kind] = slot = tab.no_result()
        return slot
