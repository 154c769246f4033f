"""What starts and stops the app's jobs: a model run on the current data and run options (``r``,
enter, a typed name), a preset's or a config file's runs (or its sweep), a lab tab's experiment,
the options dialog (``o``) that sets the next jobs' options, and cancelling (``x``). Jobs go to
the backend; their events come back through :mod:`isotui.tui.job_events`."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from isotui.config import load_run_config
from isotui.errors import IsotuiError
from isotui.paths import resource_dir
from isotui.presets import find_preset
from isotui.spec import SPEC_OPTIONS, RunSpec, make_spec
from isotui.sweep import SweepRequest
from isotui.tui.options import OptionsScreen
from isotui.tui.wording import in_options_terms

if TYPE_CHECKING:
    from isotui.tui.host import AppState


class Launcher:
    """Turns the user's picks into backend jobs (every refusal is one notification)."""

    def __init__(self, app: AppState) -> None:
        self.app = app

    def spec_for(self, model: str, overrides: dict[str, Any] | None = None) -> RunSpec:
        """The spec of a job from the app: its max length is a ceiling, capped at the model's
        limit (said in a notice) where the CLI refuses an explicit ``--max-length``."""
        try:
            spec = make_spec(model, **{**self.app.spec_defaults, **(overrides or {})})
        except IsotuiError as exc:
            raise IsotuiError(in_options_terms(str(exc))) from None
        return replace(spec, cap_max_length=True)

    def submit(self, model: str, overrides: dict[str, Any] | None = None) -> None:
        app = self.app
        if app.backend is None:
            return
        try:
            spec = self.spec_for(model, overrides)
        except IsotuiError as exc:
            app.notify(str(exc), severity="error")
            return
        app.backend.submit(spec)

    def submit_request(self, request: Any) -> None:
        """Queue an attention-lab experiment (its experiment's request)."""
        if self.app.backend is not None:
            self.app.backend.submit(request)

    def run_selected(self) -> None:
        if not self.app.selected:
            self.app.notify("select or type a model first", severity="warning")
            return
        self.submit(self.app.selected)

    def run_preset(self, name: str) -> None:
        """Every model of the preset, on the preset's own data settings (defaults unchanged)."""
        path = find_preset(name)
        if path is None:
            self.app.notify(f"preset {name} is gone from {resource_dir('sample_configs')}", severity="error")
            return
        self.run_config(path, name)

    def run_config(self, path: Path, name: str | None = None) -> None:
        """A config file (a preset, or a typed ``.toml`` path): with a ``[sweep]`` table, one sweep
        job over its tasks (its runs join the comparison when it ends); else a run per model."""
        app = self.app
        name = name or path.stem
        try:
            cfg = load_run_config(path)
        except IsotuiError as exc:
            app.notify(str(exc), severity="error")
            return
        if "sweep" in cfg:
            if app.backend is not None:
                app.backend.submit(SweepRequest(path.resolve()))
                app.notify(f"sweep {name}: queued; its tasks show as one job (x cancels it)")
            return
        overrides = {k: cfg[k] for k in SPEC_OPTIONS if k in cfg}
        models = cfg.get("models", ["minilm"])
        for model in models:
            self.submit(model, overrides)
        app.selected = models[0]
        app.main_screen.show_table()
        app.notify(f"preset {name}: queued {', '.join(models)}")

    def cancel(self) -> None:
        """The job picked in the jobs pane (when it has the focus), else the newest in flight."""
        app = self.app
        jobs = app.main_screen.jobs()
        job = jobs.chosen_job() if jobs.has_focus else None
        if job is None or not jobs.records[job].active:
            job = jobs.latest_active()
        if job is None or app.backend is None or not app.backend.cancel(job):
            app.notify("no job in flight to cancel", severity="warning")
            return
        jobs.mark_cancelling(job)
        app.notify(f"cancelling job {job} ({jobs.records[job].model})")

    def options(self) -> None:
        """The options dialog; what it applies is the next jobs' options (and the session's)."""
        app = self.app

        def done(options: dict[str, Any] | None) -> None:
            if options is not None:
                app.spec_defaults = options
                app.notify("options set for the next jobs: " + self.options_summary())
                app.save_session()

        app.push_screen(OptionsScreen(app.spec_defaults), done)

    def options_summary(self) -> str:
        o = self.app.spec_defaults
        return (
            f"data {o.get('data')}, samples {o.get('max_samples') or 'all'}, "
            f"max length {o.get('max_length') or 'auto'}, batch size {o.get('batch_size') or 'auto'}, "
            f"device {o.get('device', 'auto')}, dtype {o.get('dtype', 'auto')}, "
            f"special tokens {o.get('special_tokens', 'exclude')}, map units {o.get('map_units', 'auto')}"
            + (", exact (2nd pass)" if o.get("exact") else "")
        )
