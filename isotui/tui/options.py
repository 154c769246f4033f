"""The data and run options dialog: what the next job measures, and how it runs.

Values are checked as the headless command checks its flags (:func:`isotui.spec.make_spec`),
plus whether a data file exists, so a mistake shows here, in one sentence, not as a failed job.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select, Static

from isotui.data.sources import MEDIA, check_source, parse_data
from isotui.errors import IsotuiError
from isotui.spec import OPTIONS_BY_NAME, RUN_OPTIONS, make_spec

# The dialog's fields, from the run options that declare one (isotui.spec): free text (key,
# label, hint; empty means the option's default: "all" / "auto"), then menus (key, label,
# values), then on/off switches (key, label).
TEXT_FIELDS = tuple((o.name, o.label, o.hint) for o in RUN_OPTIONS if o.label and not o.menu and not o.switch)
CHOICES = tuple((o.name, o.label, o.menu) for o in RUN_OPTIONS if o.label and o.menu)
SWITCHES = tuple((o.name, o.label) for o in RUN_OPTIONS if o.label and o.switch)


FILE_SCHEMES = ("text", "jsonl", *MEDIA)  # data sources that name a file or folder


def check_options(options: dict[str, Any]) -> None:
    """Raise :class:`IsotuiError` (one sentence) when the options cannot make a job; a missing
    data file or folder is said with the folder its relative path started from (``base_dir``:
    the settings file's folder for its ``[run]`` table, else where the app was started)."""
    spec = make_spec("minilm", **options)
    if spec.data.scheme not in FILE_SCHEMES:
        return
    try:
        check_source(spec.data)
    except IsotuiError as exc:
        base = Path(options.get("base_dir") or Path.cwd())
        typed = str(options.get("data", "")).partition(":")[2]
        if Path(typed).expanduser().is_absolute():
            raise
        whose = "where isotui was started" if base == Path.cwd() else "the settings file's folder"
        raise IsotuiError(f"{exc} (relative paths start from {base}, {whose})") from None


def typed_data(text: str, started_in: Path) -> str:
    """A data source typed into the dialog, its relative path made absolute from the folder the
    app was started in: what jobs and the session keep, wherever the settings file lives."""
    try:
        spec = parse_data(text, started_in)
    except IsotuiError:  # check_options says what is wrong with it
        return text
    return spec.describe() if spec.scheme in FILE_SCHEMES else text


class OptionsScreen(ModalScreen[dict[str, Any] | None]):
    """Returns the new options (dismiss) or None when the user backs out."""

    BINDINGS: ClassVar[list[Binding | tuple[str, str] | tuple[str, str, str]]] = [
        Binding("escape", "cancel", "Back", id="options_cancel", priority=True),  # even in a field
        Binding("ctrl+s", "apply", "Apply", id="options_apply", priority=True),
    ]

    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__()
        self.options = dict(options)

    def compose(self) -> ComposeResult:
        with Vertical(id="options-box"):
            yield Static("data and run options for the next jobs", id="options-title")
            with Grid(id="options-grid"):
                for key, label, hint in TEXT_FIELDS:
                    value = self.options.get(key)
                    yield Label(label)
                    text = "" if value is None else str(value)
                    yield Input(text, placeholder=hint, id=f"opt-{key}", compact=True)
                for key, label, choices in CHOICES:
                    current = str(self.options.get(key) or choices[0])
                    values = choices if current in choices else (current, *choices)
                    yield Label(label)
                    options = [(c, c) for c in values]
                    yield Select(options, value=current, allow_blank=False, id=f"opt-{key}", compact=True)
                for key, label in SWITCHES:
                    yield Label(label)
                    current = "on" if self.options.get(key) else "off"
                    on_off = [("off", "off"), ("on", "on")]
                    yield Select(on_off, value=current, allow_blank=False, id=f"opt-{key}", compact=True)
            yield Static("", id="options-error")
            with Horizontal(id="options-buttons"):
                yield Button("Apply (ctrl+s)", variant="primary", id="options-apply", compact=True)
                yield Button("Back (esc)", id="options-cancel", compact=True)

    def on_mount(self) -> None:
        self.query_one(f"#opt-{TEXT_FIELDS[0][0]}", Input).focus()

    def collect(self) -> dict[str, Any]:
        """The options as set in the dialog; a data source typed here has its relative path
        taken from where the app was started (``base_dir`` says so for the check), not from the
        settings file's folder that a ``[run]`` table's paths start from."""
        out = dict(self.options)
        for key, _, _ in TEXT_FIELDS:
            text = self.query_one(f"#opt-{key}", Input).value.strip()
            out[key] = text or OPTIONS_BY_NAME[key].default
        if str(out.get("data")) != str(self.options.get("data")):
            out["base_dir"] = Path.cwd()
        for key, _, _ in CHOICES:
            out[key] = self.query_one(f"#opt-{key}", Select).value
        for key, _ in SWITCHES:
            out[key] = self.query_one(f"#opt-{key}", Select).value == "on"
        return out

    def action_apply(self) -> None:
        options = self.collect()
        try:
            check_options(options)
        except IsotuiError as exc:
            from rich.text import Text

            from isotui.tui.wording import in_options_terms

            said = Text(in_options_terms(str(exc)))  # paths as typed: no markup read in them
            self.query_one("#options-error", Static).update(said)
            return
        if "base_dir" in options and options["base_dir"] != self.options.get("base_dir"):
            options["data"] = typed_data(str(options["data"]), options["base_dir"])
            options["base_dir"] = self.options.get("base_dir")  # the settings file's, for the rest
        self.dismiss(options)

    def action_cancel(self) -> None:
        self.dismiss(None)

    def on_input_submitted(self, _: Input.Submitted) -> None:
        self.action_apply()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "options-apply":
            self.action_apply()
        else:
            self.action_cancel()
