"""Headless Chromium through Selenium: how the browser tests open the page and how `--screenshot` takes a picture.

Debian's `chromium` and `chromium-driver` (scripts/setup-browser installs them), or the binaries named by
SLOTMAP_CHROMIUM and SLOTMAP_CHROMEDRIVER. The flags keep Chromium from reaching for the network (update
checks, sync, QUIC), which on a machine without one stalls its start; each browser gets a fresh profile.
"""

from __future__ import annotations

import io
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from selenium.webdriver.remote.webdriver import WebDriver

FLAGS = (
    "--headless",
    "--no-sandbox",  # root in a container has no user namespace for the sandbox
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)
INSTALL_HINT = "scripts/setup-browser installs them (Debian/Ubuntu: apt-get install chromium chromium-driver)"


class BrowserUnavailableError(RuntimeError):
    """No Chromium, chromedriver or Selenium here; the message says which and how to get it."""


def find_browser() -> tuple[str, str]:
    """(chromium, chromedriver) paths, or BrowserUnavailableError naming what is missing."""
    try:
        import selenium  # noqa: F401
    except ImportError as e:
        raise BrowserUnavailableError("selenium is not installed: pip install -e '.[dev]' (scripts/setup)") from e
    found = []
    for variable, names in (
        ("SLOTMAP_CHROMIUM", ("chromium", "chromium-browser", "google-chrome")),
        ("SLOTMAP_CHROMEDRIVER", ("chromedriver",)),
    ):
        path = os.environ.get(variable) or next((p for n in names if (p := shutil.which(n))), None)
        if path is None or not os.access(path, os.X_OK):
            raise BrowserUnavailableError(f"no {names[0]} on PATH (or in ${variable}): {INSTALL_HINT}")
        found.append(path)
    return found[0], found[1]


@contextmanager
def headless_chromium(width: int = 1500, height: int = 1100) -> Iterator[WebDriver]:
    """A headless Chromium with a fresh profile, closed (profile removed) on exit."""
    chromium, chromedriver = find_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    with tempfile.TemporaryDirectory(prefix="slotmap-chromium-") as profile:
        options = webdriver.ChromeOptions()
        options.binary_location = chromium
        for flag in (*FLAGS, f"--window-size={width},{height}", f"--user-data-dir={profile}"):
            options.add_argument(flag)
        options.set_capability("goog:loggingPrefs", {"browser": "SEVERE"})  # the page's errors: driver.get_log
        driver = webdriver.Chrome(service=Service(chromedriver), options=options)
        try:
            yield driver
        finally:
            driver.quit()


def screenshot(page: Path, png: Path, step: int | None = None, token: int = 0, width: int = 1500) -> None:
    """A PNG of the page at `step` (default: where the page opens) with flat token `token` selected, full height."""
    fragment = "" if step is None else f"#step={step}&token={token}"
    with headless_chromium(width) as driver:
        driver.get(page.resolve().as_uri() + fragment)
        height = int(driver.execute_script("return document.documentElement.scrollHeight"))
        driver.set_window_size(width, height)
        # the window's size includes its frame: grow it by what the viewport still lacks
        inner = int(driver.execute_script("return window.innerHeight"))
        driver.set_window_size(width, 2 * height - inner)
        shot = driver.get_screenshot_as_png()
    _save_small(shot, png)


def _save_small(shot: bytes, png: Path) -> None:
    """A page has few colours: a 256-colour palette PNG keeps every label and colour at a third of the bytes."""
    from PIL import Image  # matplotlib's dependency

    with Image.open(io.BytesIO(shot)) as image:
        palette = image.convert("RGB").quantize(256, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE)
        palette.save(png, optimize=True)
