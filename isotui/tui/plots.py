"""The app's plot widget: a PlotextPlot whose title and x label always show.

plotext leaves out a label that does not fit its width (``check_space``): a long title was blank
on an 80-column terminal and, before the first layout, on first display. Here each is cut to the
widget's width at every render instead (the full text stays set, so a wider window shows it all).
"""

from __future__ import annotations

from textual_plotext import PlotextPlot


def fit(text: str | None, width: int) -> str | None:
    """``text`` cut to ``width`` cells with an ellipsis (plotext counts one cell per character)."""
    if not text or len(text) <= width:
        return text
    return text[: max(width - 1, 0)] + "…" if width > 1 else None


class FitPlot(PlotextPlot):
    def render(self):
        monitor = self.plt.monitor
        title, xlabel = monitor.title, list(monitor.xlabel)
        width = self.size.width - 6  # plotext keeps a margin either side of a centred label
        monitor.title = fit(title, width)
        monitor.xlabel = [fit(label, width) for label in xlabel]
        try:
            return super().render()
        finally:
            monitor.title, monitor.xlabel = title, xlabel
