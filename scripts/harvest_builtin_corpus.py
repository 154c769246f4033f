"""Harvest the built-in English corpus from the Python standard library's docstrings.

Run once by a maintainer; its output, ``isotui/data/builtin_corpus.txt``, is committed so that
every machine reads the same sentences whatever its Python version. Re-running it on another
Python version gives a different file: that is a new corpus version (bump BUILTIN_VERSION).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
import sys
import warnings
from pathlib import Path

SENTENCE_END = re.compile(r"(?<=[a-z][.!?])\s+(?=[A-Z])")
MODULES_SKIPPED = ("test", "idlelib", "tkinter", "turtledemo", "lib2to3", "antigravity", "this")


def _docstrings() -> list[str]:
    docs: list[str] = []
    names = sorted(m.name for m in pkgutil.iter_modules() if m.name in sys.stdlib_module_names)
    for name in names:
        if name.startswith("_") or name.startswith(MODULES_SKIPPED):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(name)
        except Exception:
            continue
        seen: set[int] = set()
        for obj in [module, *(v for _, v in sorted(vars(module).items()))]:
            if id(obj) in seen or getattr(obj, "__module__", name) != name:
                continue
            seen.add(id(obj))
            documented = inspect.isclass(obj) or inspect.isfunction(obj) or inspect.ismodule(obj)
            doc = inspect.getdoc(obj) if documented else None
            if doc:
                docs.append(doc)
            if inspect.isclass(obj):
                for _, member in sorted(vars(obj).items()):
                    if inspect.isfunction(member) and (mdoc := inspect.getdoc(member)):
                        docs.append(mdoc)
    return docs


def _sentences(doc: str) -> list[str]:
    out = []
    for para in doc.split("\n\n"):
        if para.lstrip().startswith((">>>", "-", "*", "|")) or "    " in para:
            continue
        flat = " ".join(para.split())
        out.extend(s.strip() for s in SENTENCE_END.split(flat))
    return out


def _is_prose(s: str) -> bool:
    words = s.split()
    if not 8 <= len(words) <= 60 or not s[0].isupper() or s[-1] not in ".!?":
        return False
    letters = sum(c.isalpha() or c == " " for c in s)
    return letters / len(s) > 0.9 and not re.search(r"[{}=<>\[\]\\_]|::|\(\)", s)


def main() -> None:
    seen: set[str] = set()
    kept = []
    for doc in _docstrings():
        for s in _sentences(doc):
            if _is_prose(s) and s not in seen:
                seen.add(s)
                kept.append(s)
    out = Path(__file__).resolve().parents[1] / "isotui" / "data" / "builtin_corpus.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(kept) + "\n", encoding="utf-8")
    print(f"{len(kept)} sentences from Python {sys.version.split()[0]} -> {out}")


if __name__ == "__main__":
    main()
