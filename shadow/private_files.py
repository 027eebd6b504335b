"""Files slotmap writes on its own initiative go where only the user can write, and never replace anything.

A shared temporary directory is writable by every local user: a fixed name there (`/tmp/slotmap-shadow`)
can be created first by someone else, as a folder they own or a symlink to a file of the user's, and a
script the user is then told to run is theirs. So: a directory the caller named, or a fresh private one
(`tempfile.mkdtemp`, mode 0700); and every file created exclusively (`O_CREAT | O_EXCL | O_NOFOLLOW`:
an existing file or symlink of that name is never opened, followed or truncated), the next free name taken
instead, and the path actually written returned.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

_EXCLUSIVE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
MAX_NAME_TRIES = 1000  # name, name-2, ..., before giving up: a folder that full is not an accident


def private_dir(prefix: str) -> Path:
    """A new directory only the current user can enter (mode 0700), under the temporary directory."""
    return Path(tempfile.mkdtemp(prefix=prefix))


def create_new(path: Path, text: str) -> None:
    """Write `text` to a file that did not exist; FileExistsError if anything (a symlink too) has that name."""
    fd = os.open(path, _EXCLUSIVE, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)


def create_unique(folder: Path, stem: str, suffix: str, text: str) -> Path:
    """Write `text` to `folder/stem+suffix`, or `stem-2+suffix`, ...: the first name nothing holds. Returns it."""
    for n in range(1, MAX_NAME_TRIES + 1):
        path = folder / f"{stem}{'' if n == 1 else f'-{n}'}{suffix}"
        try:
            create_new(path, text)
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"{folder}: {stem}{suffix} and {MAX_NAME_TRIES - 1} numbered names are all taken")
