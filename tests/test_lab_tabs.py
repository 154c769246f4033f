"""The lab from the registry (issue 25 item 3): an experiment that names a lab tab gets its tab, its
keys, its help lines and its result slot without a line of the app changing.

The demo below is a whole experiment with a lab tab, registered the way a new one is (its
``Experiment`` with ``lab_tab="module:attr"`` in the registry's table): the average cosine of
seeded Gaussian vectors around a shared offset, computed through the app's backend and checked
against numpy over all pairs.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable, Input, TabbedContent

from isotui.backend import Backend
from isotui.experiments import registry
from isotui.experiments.base import Context, Experiment
from isotui.experiments.params import param
from isotui.tui.app import IsotuiApp
from isotui.tui.lab import LabScreen
from isotui.tui.lab_tab import LabTab

from .test_tui import _wait

# --- the demo experiment and its tab -----------------------------------------------------------


@dataclass(frozen=True)
class DemoResult:
    n: int
    dim: int
    seed: int
    avg_cos: float
    from_cache: bool = False

    @property
    def rows(self) -> list[dict[str, Any]]:
        return [{"n": self.n, "dim": self.dim, "seed": self.seed, "avg_cos": self.avg_cos}]


def demo_vectors(n: int, dim: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, dim)) + 0.5  # a shared offset: clearly anisotropic


@dataclass(frozen=True)
class DemoRequest:
    kind: ClassVar[str] = "demo-avg-cos"
    n: int
    dim: int
    seed: int

    @property
    def model(self) -> str:
        return f"gaussian {self.n}x{self.dim}"

    @property
    def device(self) -> str:
        return "cpu"

    def keys(self, cache_root: Path | None) -> list[str]:
        return []

    def lookup(self, cache_root: Path | None, notice: Any) -> Any:
        return None

    def compute(self, context: Context) -> Any:
        from isotui.core.accumulator import avg_cos_from_sums

        x = demo_vectors(self.n, self.dim, self.seed)
        u = x / np.linalg.norm(x, axis=1, keepdims=True)
        return DemoResult(self.n, self.dim, self.seed, avg_cos_from_sums(u.sum(axis=0), self.n))


class DemoTab(LabTab):
    KIND = "demo-avg-cos"
    BOX = "#demo-input"
    TABLE = "#demo-table"
    KEY, NAME, TITLE, SHORT = "6", "demo", "Demo", "Demo"
    TOOLTIP = "tab: the demo's average cosine"
    KEYS = (Binding("z", "flip", "Flip", id="lab_demo_flip", tooltip="Demo: flip the sign shown"),)
    WIDGET_KEYS = (("↑ ↓", "the demo's rows"),)
    DEFAULT_CSS = "#demo-table { height: 1fr; }"

    def __init__(self, title: str, *, id: str) -> None:
        super().__init__(title, id=id)
        self.sign = 1

    def compose(self) -> ComposeResult:
        yield Input(placeholder="n dim seed; enter runs", id="demo-input")
        yield DataTable(id="demo-table")

    def show(self) -> None:
        table = self.query_one("#demo-table", DataTable)
        table.clear(columns=True)
        result = self.result()
        if result is not None:
            table.add_columns("n", "dim", "seed", "avg_cos")
            table.add_row(
                str(result.n), str(result.dim), str(result.seed), f"{self.sign * result.avg_cos:.6f}"
            )

    def run(self) -> bool:
        n, dim, seed = (int(v) for v in self.query_one("#demo-input", Input).value.split())
        self.host.submit_request(DemoRequest(n, dim, seed))
        self.lab.status("queued the demo")
        return True

    def action_flip(self) -> None:
        self.sign = -self.sign
        self.show()


@dataclass(frozen=True)
class DemoParams:
    """The demo's own parameters: its flags and keywords (``isotui experiment demo-avg-cos --n 8``)."""

    n: int = param(64, parse=int, help="vectors")
    dim: int = param(8, parse=int, help="their dimension")
    seed: int = param(0, parse=int, help="the generator's seed")


DEMO = Experiment(
    name="demo-avg-cos",
    help="the average cosine of seeded Gaussian vectors (a demo)",
    request_type=DemoRequest,
    result_type=DemoResult,
    folder=None,
    schema=1,
    view="demo-avg-cos",
    inputs="config",
    make_request=lambda _spec, params: DemoRequest(params.n, params.dim, params.seed),
    params=DemoParams,
    rows=lambda results: [row for r in results for row in r.rows],
    payload=lambda results: {"results": [r.rows for r in results]},
    run_options=(),
    lab_tab="tests.test_lab_tabs:DemoTab",
)

# --- tests ---------------------------------------------------------------------------------------

# The lab's keys before they were composed from the registry (isotui/tui/lab.py at f366e1b), with
# the Token types tab (5) that token-types' registry entry brought since.
LAB_KEYS_BEFORE = [
    ("escape", "lab_close"),
    ("1", "lab_heads"),
    ("2", "lab_dynamics"),
    ("3", "lab_drift"),
    ("4", "lab_ckpt"),
    ("5", "lab_types"),
    ("r", "lab_run"),
    ("m", "lab_figure"),
    ("left_square_bracket", "lab_head_prev"),
    ("right_square_bracket", "lab_head_next"),
    ("b", "lab_basis"),
    ("l", "lab_log"),
    ("e", "lab_export"),
    ("question_mark,f1", "lab_help"),
]
TABS_BEFORE = [
    ("tab-heads", "1 Heads"),
    ("tab-dynamics", "2 Dynamics"),
    ("tab-drift", "3 Drift block"),
    ("tab-ckpt", "4 Checkpoints"),
    ("tab-types", "5 Token types"),
]


@pytest.fixture
def with_demo(monkeypatch, app_tabs_only):
    """The registry with the demo experiment added (as its one line in the table would)."""
    monkeypatch.setattr(registry, "REGISTRY", (*registry.REGISTRY, DEMO))


def _app(tmp_path: Path) -> IsotuiApp:
    return IsotuiApp(
        cache_root=tmp_path / "cache",
        export_dir=tmp_path,
        device_probe=lambda: "test",
        backend_factory=lambda cache, post: Backend(cache, post, processes=False),
    )


def _tabs(lab: LabScreen) -> list[tuple[str, str]]:
    tabbed = lab.query_one("#lab-tabs", TabbedContent)
    return [(pane.id or "", str(tabbed.get_tab(pane).label)) for pane in tabbed.query("TabPane").results()]


def test_the_registered_lab_is_the_one_it_was(tmp_path, app_tabs_only):
    """Composed from today's registry, the lab has the same tabs, keys, key ids and order as when
    they were written out in lab.py, and the demo's tab is not among them."""

    async def scenario():
        app = _app(tmp_path)
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press("A")
            await pilot.pause()
            lab = app.screen
            assert isinstance(lab, LabScreen)
            assert [(b.key, b.id) for b in lab.keys] == LAB_KEYS_BEFORE
            # the screen's own keys stay bound too: tab moves the focus (box -> table)
            bound = [(b.key, b.action) for bs in lab._bindings.key_to_bindings.values() for b in bs]
            assert bound[:2] == [("tab", "app.focus_next"), ("shift+tab", "app.focus_previous")]
            await pilot.press("2")
            await pilot.pause()
            assert lab.query_one("#dyn-input", Input).has_focus
            await pilot.press("tab")
            assert lab.query_one("#dyn-table", DataTable).has_focus
            assert _tabs(lab) == TABS_BEFORE
            assert app.lab_results["qk-dynamics"] is None and app.lab_results["attention"] == {}
            assert app.lab_results["token-types"] == {}
            with pytest.raises(KeyError):
                app.lab_results["demo-avg-cos"]

    asyncio.run(scenario())


def test_a_registered_experiment_brings_its_tab_keys_help_and_result(tmp_path, with_demo):
    """The demo, added to the registry alone: its tab (key 6), its own key (z, offered on its tab
    only), its help lines, and its job run through the app's backend into its slot and its table."""
    from isotui.tui.help import HelpScreen

    async def scenario():
        app = _app(tmp_path)
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.press("A")
            await pilot.pause()
            lab = app.screen
            assert _tabs(lab) == [*TABS_BEFORE, ("tab-demo", "6 Demo")]
            keys = [(b.key, b.id) for b in lab.keys]
            assert keys == [
                *LAB_KEYS_BEFORE[:6],
                ("6", "lab_demo"),
                *LAB_KEYS_BEFORE[6:11],
                ("z", "lab_demo_flip"),
                *LAB_KEYS_BEFORE[11:],
            ]
            assert lab.check_action("flip", ()) is False  # the Heads tab is shown
            await pilot.press("6")
            await pilot.pause()
            assert lab.query_one("#lab-tabs", TabbedContent).active == "tab-demo"
            box = lab.query_one("#demo-input", Input)
            assert box.has_focus  # nothing run yet: its settings box takes the cursor
            box.value = "300 24 7"
            await pilot.press("enter")
            await _wait(pilot, lambda: app.lab_results["demo-avg-cos"] is not None, timeout=60)
            result = app.lab_results["demo-avg-cos"]
            x = demo_vectors(300, 24, 7)
            cos = (x @ x.T) / np.outer(np.linalg.norm(x, axis=1), np.linalg.norm(x, axis=1))
            want = cos[~np.eye(300, dtype=bool)].mean()  # every distinct pair
            assert result.avg_cos == pytest.approx(want, rel=1e-9) and want > 0.1
            await _wait(pilot, lambda: lab.query_one("#demo-table", DataTable).row_count == 1)
            table = lab.query_one("#demo-table", DataTable)
            assert table.get_row_at(0)[3] == f"{want:.6f}"
            assert "demo-avg-cos ready" in str(lab.query_one("#lab-status").render())
            assert app.lab_inputs["demo-input"] == "300 24 7"  # kept for the next visit and session
            table.focus()
            assert lab.check_action("flip", ()) is True
            shown = {b.binding.id for b in lab.active_bindings.values() if b.enabled}
            assert "lab_demo_flip" in shown and "lab_basis" not in shown and "lab_log" not in shown
            await pilot.press("z")  # the tab's own key runs the tab's own action
            await pilot.pause()
            assert table.get_row_at(0)[3] == f"{-want:.6f}"
            await pilot.press("question_mark")
            await pilot.pause()
            assert isinstance(app.screen, HelpScreen)
            rows = {row[1]: row for row in app.screen.rows() if row[1]}
            assert rows["lab_demo"][0] == "6" and rows["lab_demo"][2] == "tab: the demo's average cosine"
            assert rows["lab_demo_flip"][0] == "z"
            arrows = next(what for key, ident, what in app.screen.rows() if key == "↑ ↓" and not ident)
            assert arrows.endswith("; Demo: the demo's rows")

    asyncio.run(scenario())


def test_a_bad_lab_tab_entry_is_said(monkeypatch):
    from dataclasses import replace

    from isotui.tui.lab_tabs import lab_tabs

    before = registry.REGISTRY
    for entry, said in (
        ("isotui.tui.lab_heads:HEAD_METRICS", "is not a LabTab class"),
        ("isotui.tui.lab_heads:HeadsTab", "is the tab of 'attention'"),
    ):
        monkeypatch.setattr(registry, "REGISTRY", (*before, replace(DEMO, lab_tab=entry)))
        with pytest.raises(ValueError, match=said):
            lab_tabs()
    clash = type("ClashTab", (DemoTab,), {"KEY": "1"})
    monkeypatch.setattr("tests.test_lab_tabs.ClashTab", clash, raising=False)
    monkeypatch.setattr(
        registry, "REGISTRY", (*before, replace(DEMO, lab_tab="tests.test_lab_tabs:ClashTab"))
    )
    with pytest.raises(ValueError, match="key '1' shows attention"):
        lab_tabs()
