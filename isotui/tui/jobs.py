"""The jobs pane: every queued or running job with a progress bar, speed, ETA, device and memory.

The pane keeps its own small record per job from the backend's events (the backend stays
UI-free); finished jobs stay listed a while, newest first after the running ones, so the user
sees what happened to a job that ended while they looked elsewhere.

On a short terminal (under 30 rows, the screen's ``-short``) the pane is folded to its one title
line, a summary (``jobs: 1 running, 3 done (j: show) · gpt2 45%, ETA 0:12``), so the layer
table and the plot keep their rows however many jobs there are; the app's ``jobs`` key unfolds
it (class ``-open``) and folds it again (``-shut``, also on a tall terminal).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from textual.widgets import DataTable
from textual.widgets.data_table import CellDoesNotExist

from isotui.backend import (
    JobCancelled,
    JobEvent,
    JobFailed,
    JobFinished,
    JobNotice,
    JobProgress,
    JobQueued,
    JobStarted,
    devices_label,
)
from isotui.extract.progress import Progress
from isotui.extract.threads import load_average, usable_cores
from isotui.render import distinct_names, shorten

JOB_COLUMNS = ("job", "model", "state", "progress", "tok/s", "ETA", "device", "memory")
KEEP_FINISHED = 3
MODEL_WIDTH = 32  # the model column's cells
BAR_WIDTH = 12
# a job's state is the phase it is in, as its progress events say (extract/progress.PHASES):
# no "running 0%" while the model loads, no 100% while the metrics are finalised
PREPARING = ("resolving", "loading", "tokenising")
COMPUTING = ("running", "second pass", "finalising", "writing")
ACTIVE = ("queued", *PREPARING, *COMPUTING, "cancelling")


def phase_state(progress: Progress) -> str:
    """The jobs pane's state word for a progress event: its phase (``running`` when a producer
    does not say, as the attention experiments' passes)."""
    if progress.phase in PREPARING or progress.phase in COMPUTING:
        return progress.phase
    return "finalising" if progress.stage == "finalize" else "running"


SLOW_START_S = 10.0  # a job with no sample done after this long says why, when the CPU is busy


def waiting_for_cpu(load: float | None = None, cores: int | None = None) -> str:
    """``waiting for CPU: load 20 on 2 cores`` when the 1-minute load average is above the cores
    this process may use (a job's worker runs at a lower priority, so on a busy machine it may
    get no core for minutes), else ''."""
    load = load_average() if load is None else load
    cores = usable_cores() if cores is None else cores
    if load is None or load <= cores:
        return ""
    return f"waiting for CPU: load {load:.0f} on {cores} core{'s' if cores != 1 else ''}"


def progress_bar(done: int, total: int, width: int = BAR_WIDTH) -> str:
    """``██████░░░░░░  50%``: a text bar that any terminal (and NO_COLOR) shows."""
    frac = min(max(done / total, 0.0), 1.0) if total > 0 else 0.0
    full = round(frac * width)
    return "█" * full + "░" * (width - full) + f" {frac * 100:3.0f}%"


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = round(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}:{seconds % 60:02d}"


def summary(records: list[JobRecord]) -> str:
    """``1 running, 1 queued, 3 done``: the jobs counted by state (a running job's phases are
    "running"); '' for none."""
    counts: dict[str, int] = {}
    for rec in records:
        word = "running" if rec.state in (*PREPARING, *COMPUTING) else rec.state
        counts[word] = counts.get(word, 0) + 1
    order = ("running", "cancelling", "queued", "done", "cached", "failed", "cancelled")
    return ", ".join(f"{counts[w]} {w}" for w in order if counts.get(w))


def running_note(records: list[JobRecord], name_width: int = 24) -> str:
    """``gpt2 45%, ETA 0:12``: the oldest running job's model (told apart from the others listed,
    in at most ``name_width`` cells) and progress (its phase while it prepares or finalises); ''
    when none runs."""
    at = next((i for i, r in enumerate(records) if r.state in (*PREPARING, *COMPUTING)), None)
    if at is None:
        return ""
    rec, name = records[at], distinct_names([r.model for r in records], name_width)[at]
    p = rec.progress
    if p is not None and rec.state in ("running", "second pass") and p.samples_total > 0:
        done = min(max(p.samples_done / p.samples_total, 0.0), 1.0)
        return f"{name} {done * 100:.0f}%, ETA {duration(p.eta_s)}"
    return f"{name} {rec.state}"


def memory_text(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB" if n else "-"


@dataclass
class JobRecord:
    job_id: int
    model: str
    device: str
    state: str = "queued"
    progress: Progress | None = None
    counts: str = "samples"  # what its progress counts: a sweep's counts tasks
    since: float = field(default_factory=time.monotonic)  # when its state or samples last moved

    @property
    def active(self) -> bool:
        return self.state in ACTIVE

    def stalled(self, now: float | None = None) -> bool:
        """Whether it has been at no sample done for :data:`SLOW_START_S` or more (a layer run;
        a sweep's tasks take long by nature)."""
        waiting = self.progress is None or self.progress.samples_done == 0
        now = time.monotonic() if now is None else now
        started = self.state in ("queued", *PREPARING, "running")
        return started and waiting and self.counts == "samples" and now - self.since >= SLOW_START_S

    def cells(self, why: str = "", name: str | None = None) -> tuple[str, ...]:
        """The row; ``why``: what the progress cell says instead of a bar at 0% (a busy CPU);
        ``name``: the model as the pane shows it (told apart from the other rows' models)."""
        p = self.progress
        bar = speed = eta = ""
        if why:
            bar = why
        elif p is not None and self.state in (*PREPARING, "writing"):
            bar = p.detail  # what is known: the model's size while it loads, the samples to tokenise
        elif p is not None and self.state == "finalising" and p.layers_total:
            bar, eta = f"{progress_bar(p.layers_done, p.layers_total)} layers", duration(p.eta_s)
        elif p is not None and self.state in ("running", "second pass", "cancelling"):
            bar = progress_bar(p.samples_done, p.samples_total)
            speed = f"{p.tokens_per_s:,.0f}"
            eta = duration(p.eta_s)
            if self.counts == "tasks":  # a sweep: its bar counts tasks (each a process: no tokens here)
                bar, speed = f"{bar} {p.samples_done}/{p.samples_total} tasks", ""
        memory = memory_text(p.memory_bytes) if p is not None else "-"
        name = shorten(self.model, MODEL_WIDTH) if name is None else name
        return (str(self.job_id), name, self.state, bar, speed, eta, self.device, memory)


class JobsTable(DataTable[str]):
    """Focus it (tab or click) to pick a job; the app's cancel key then cancels that one.
    Folded (see the module docstring) it is its title line alone, and takes no focus."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(cursor_type="row", zebra_stripes=False, **kwargs)
        self.records: dict[int, JobRecord] = {}
        self.fold_key = "j"  # the app's key that folds and unfolds it, as bound (said in the title)

    @property
    def folded(self) -> bool:
        """Shown as its title line alone: folded by the user, or on a short screen unless unfolded."""
        if self.has_class("-shut"):
            return True
        return not self.has_class("-open") and self.is_mounted and self.screen.has_class("-short")

    def toggle_fold(self) -> None:
        """The app's ``jobs`` key: unfold a folded pane, fold an open one."""
        unfold = self.folded
        self.set_class(unfold, "-open")
        self.set_class(not unfold, "-shut")
        self.screen.set_class(unfold, "-jobs-open")  # the layer table gives way as the plot does
        if not unfold and self.has_focus:
            self.screen.focus_next()
        self._titles()

    def on_resize(self) -> None:
        """Folded or unfolded by the screen's size (a short screen folds it): the title follows."""
        self._titles()

    def on_mount(self) -> None:
        for label in JOB_COLUMNS:
            self.add_column(label, key=label)
        self.redraw()
        self.set_interval(SLOW_START_S / 4, self._refresh_waits)

    def apply(self, ev: JobEvent) -> None:
        """Fold one backend event into the records and redraw."""
        rec = self.records.get(ev.job_id)
        if rec is None:
            kind = getattr(ev.spec, "kind", None)  # an attention-lab experiment, not a layer run
            label = f"{kind}: {ev.spec.model}" if kind else ev.spec.model
            counts = "tasks" if kind == "sweep" else "samples"
            device = devices_label(ev.spec) or ev.spec.device  # a device map: every device it holds
            rec = self.records[ev.job_id] = JobRecord(ev.job_id, label, device, counts=counts)
        before = (rec.state, rec.progress.samples_done if rec.progress else 0)
        if isinstance(ev, JobQueued):
            rec.state = "queued"
        elif isinstance(ev, JobStarted):
            rec.state, rec.device = "loading", ev.device
        elif isinstance(ev, JobProgress) and not ev.progress.message:
            rec.progress = ev.progress
            if rec.state != "cancelling":
                rec.state = phase_state(ev.progress)
        elif isinstance(ev, JobFinished):
            cached = getattr(ev.result, "from_cache", False)
            rec.state = "cached" if (all(cached) if isinstance(cached, tuple) else cached) else "done"
            meta = getattr(ev.result, "meta", None) or {}
            if devices_label(ev.spec) is None:
                rec.device = meta.get("device", getattr(ev.result, "device", rec.device))
        elif isinstance(ev, JobFailed):
            rec.state = "failed"
        elif isinstance(ev, JobCancelled):
            rec.state = "cancelled"
        elif isinstance(ev, JobNotice):
            return
        if (rec.state, rec.progress.samples_done if rec.progress else 0) != before:
            rec.since = time.monotonic()
        self.redraw()

    def mark_cancelling(self, job_id: int) -> None:
        rec = self.records.get(job_id)
        if rec is not None and rec.active:
            rec.state = "cancelling"
            self.redraw()

    def ordered(self) -> list[JobRecord]:
        """Active jobs oldest first, then the last few finished ones, newest first."""
        active = sorted((r for r in self.records.values() if r.active), key=lambda r: r.job_id)
        done = sorted((r for r in self.records.values() if not r.active), key=lambda r: -r.job_id)
        for old in done[KEEP_FINISHED:]:
            del self.records[old.job_id]
        return active + done[:KEEP_FINISHED]

    def redraw(self) -> None:
        """Jobs in flight first and in view; the user's pick stays picked while they look.
        The same jobs in the same order (a progress report): only the changed cells are redrawn.
        Before the table is mounted (a job submitted as the app starts) the records are kept and
        drawn once its columns are there."""
        if not self.columns:
            return
        ordered = self.ordered()
        whys = self._whys(ordered)
        names = dict(
            zip(
                (r.job_id for r in ordered),
                distinct_names([r.model for r in ordered], MODEL_WIDTH),
                strict=True,
            )
        )
        if ordered and [str(r.job_id) for r in ordered] == [str(k.value) for k in self.rows]:
            for rec in ordered:
                cells = rec.cells(whys.get(rec.job_id, ""), names[rec.job_id])
                for column, (old, new) in zip(
                    JOB_COLUMNS, zip(self.get_row(str(rec.job_id)), cells, strict=True), strict=True
                ):
                    if old != new:
                        self.update_cell(str(rec.job_id), column, new, update_width=True)
            self._titles()
            return
        chosen = self.chosen_job() if self.has_focus else None
        self.clear()
        for rec in ordered:
            self.add_row(*rec.cells(whys.get(rec.job_id, ""), names[rec.job_id]), key=str(rec.job_id))
        if chosen is not None and str(chosen) in {str(k.value) for k in self.rows}:
            self.move_cursor(row=self.get_row_index(str(chosen)), animate=False)
        else:
            self.scroll_home(animate=False)
        self.show_header = self.row_count > 0  # an idle pane takes one line
        self._titles()

    @staticmethod
    def _whys(records: list[JobRecord]) -> dict[int, str]:
        """Jobs stalled at no sample done on a busy machine: the busy CPU, said in their row. A
        queued job behind one that runs waits for that one instead, and says nothing."""
        now = time.monotonic()
        stalled = [r for r in records if r.stalled(now)]
        if not stalled:
            return {}
        why = waiting_for_cpu()
        ahead = any(r.state in (*PREPARING, *COMPUTING) for r in records)
        return {r.job_id: why for r in stalled if why and (r.state != "queued" or not ahead)}

    def _refresh_waits(self) -> None:
        """Now and then while jobs are in flight: a starved worker posts nothing, so its row is
        redrawn from here to say why it waits."""
        if any(r.active for r in self.records.values()):
            self.redraw()

    def _titles(self) -> None:
        records = list(self.records.values())
        active = sum(r.active for r in records)
        folded = self.folded and bool(records)
        self.can_focus = not folded
        if folded:
            title = f"jobs: {summary(records)} ({self.fold_key}: show)"
            # the name gives way so that the progress and ETA fit the line (" · ", "100%, ETA
            # 0:00:00" and the rule's ends)
            room = self.size.width - len(title) - len(" ·  100%, ETA 0:00:00") - 4
            note = running_note(records, min(24, max(8, room)))
            self.border_title = f"{title} · {note}" if note else title
        elif active:
            self.border_title = f"jobs ({active} in flight)"
        else:
            self.border_title = "jobs: none running (r runs one)"
        if records and not folded and self.has_class("-open"):
            self.border_title = self.border_title.replace(")", f"; {self.fold_key}: fold)")

    def chosen_job(self) -> int | None:
        """The job under the cursor, if any."""
        if self.row_count == 0:
            return None
        try:
            key = self.coordinate_to_cell_key(self.cursor_coordinate).row_key
        except CellDoesNotExist:
            return None
        return int(key.value) if key.value is not None else None

    def latest_active(self) -> int | None:
        active = [r.job_id for r in self.records.values() if r.active and r.state != "cancelling"]
        return max(active) if active else None
