"""The app's keys: each with an id (remappable in the settings file's ``[keys]``), a footer label
and a tooltip (the help screen's and the command palette's line). The main screen's own keys are
app keys too (the help and the palette list them all), hidden and inert above the main screen."""

from __future__ import annotations

from textual.binding import Binding

APP_KEYS: list[Binding] = [
    Binding("r", "run", "Run", id="run", tooltip="run the selected model on the current options"),
    Binding(
        "slash",
        "focus_input",
        "Find",
        id="type_model",
        show=False,
        tooltip="filter the list or type a model",
    ),
    Binding("a", "toggle_compare", "Compare", id="compare", tooltip="add/remove it from the comparison set"),
    Binding("m", "cycle_metric", "Metric", id="metric", tooltip="cycle the plotted metric"),
    Binding(
        "n", "toggle_depth", "Depth", id="depth", show=False, tooltip="x axis: layer index or depth 0..1"
    ),
    Binding(
        "s", "sort", "Sort", id="sort", show=False, tooltip="sort the layer table by the cursor's column"
    ),
    Binding(
        "A",
        "lab",
        "Lab",
        id="lab",
        tooltip="attention lab: queries and keys per head, checkpoint dynamics, the drift block",
    ),
    Binding("o", "options", "Options", id="options", tooltip="data and run options"),
    Binding("e", "export", "CSV", id="export", tooltip="CSV of the whole comparison set"),
    Binding(
        "E",
        "export_table",
        "Export table",
        id="export_table",
        show=False,
        tooltip="CSV of the shown table",
    ),
    Binding("S", "screenshot", "Screenshot", id="screenshot", show=False, tooltip="save an SVG screenshot"),
    Binding(
        "F",
        "save_figure",
        "PDF",
        id="figure",
        tooltip="save the plot on screen as PDF, PNG and the CSV of its numbers",
    ),
    Binding(
        "x",
        "cancel",
        "Cancel",
        id="cancel",
        tooltip="cancel the job picked in the jobs pane, else the newest",
    ),
    Binding(
        "j",
        "toggle_jobs",
        "Jobs",
        id="jobs",
        show=False,
        tooltip="unfold or fold the jobs pane (under 30 rows it is folded to a one-line summary)",
    ),
    Binding("t", "cycle_theme", "Theme", id="theme", show=False, tooltip="next theme"),
    Binding("question_mark,f1", "help", "Help", id="help", tooltip="every key"),
    Binding("q", "quit", "Quit", id="quit", show=False, tooltip="quit (running jobs are cancelled)"),
]

# app keys that belong to the main screen: hidden and inert in the attention lab
MAIN_ONLY_ACTIONS = frozenset(
    {
        "focus_input",
        "toggle_compare",
        "toggle_depth",
        "sort",
        "lab",
        "export_table",
        "run",
        "cycle_metric",
        "toggle_jobs",
    }
)
