"""Messages in the words of where the user is.

The checks behind the app are shared with the CLI and speak its flags (``--max-length 64``,
``max-samples must be ...``). The app has no flags: its options dialog names each option by its
label (``max length``) and a lab settings box by its ``key=value`` name (``heads=5``).
"""

from __future__ import annotations

import re

from isotui.spec import RUN_OPTIONS

# CLI flag (without --) -> the options dialog's label: its text fields and menus (the dialog,
# isotui/tui/options.py, shows the same options and calls this module)
_FIELDS = [o for o in RUN_OPTIONS if o.label and not o.menu and not o.switch]
OPTION_LABELS = {
    o.name.replace("_", "-"): o.label for o in (*_FIELDS, *(o for o in RUN_OPTIONS if o.label and o.menu))
}
_OPTION = re.compile(r"(?<![\w-])(?:--)?(" + "|".join(map(re.escape, OPTION_LABELS)) + r")(?![\w-])")
_FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9-]*)(?:[ =]((?:-?[\d.'\"][^\s,;)]*)))?")


def in_options_terms(message: str) -> str:
    """``use --max-length 64 or less`` -> ``use max length 64 or less`` (the dialog's labels)."""
    return _OPTION.sub(lambda m: OPTION_LABELS[m.group(1)], message)


def in_box_terms(message: str) -> str:
    """``--heads 5 does not divide --hidden 32`` -> ``heads=5 does not divide hidden=32``."""

    def key_value(m: re.Match[str]) -> str:
        name = m.group(1).replace("-", "_")
        return f"{name}={m.group(2)}" if m.group(2) else name

    return _FLAG.sub(key_value, message)
