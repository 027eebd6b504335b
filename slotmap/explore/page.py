"""Write a run as one self-contained HTML file: the page template with its style, script and data inline."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from string import Template

from slotmap.explore.export import export_run
from slotmap.explore.record import Run


def render_page(run: Run) -> str:
    """The page's HTML: nothing in it loads from the network, so it opens from a file anywhere."""
    assets = resources.files("slotmap.explore") / "assets"
    data = json.dumps(export_run(run), separators=(",", ":"))
    # "</" would end the <script> element early; "<\/" reads the same to JSON.parse
    data = data.replace("</", "<\\/")
    page = Template((assets / "page.html").read_text(encoding="utf-8"))
    return page.substitute(
        title=_escape(run.title),
        style=(assets / "page.css").read_text(encoding="utf-8"),
        script=(assets / "page.js").read_text(encoding="utf-8"),
        data=data,
    )


def write_page(run: Run, path: Path) -> int:
    """Write the page to `path`; returns its size in bytes."""
    text = render_page(run)
    path.write_text(text, encoding="utf-8")
    return len(text.encode("utf-8"))


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
