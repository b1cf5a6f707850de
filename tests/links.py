"""Putting the demo models into a test's own repository without symbolic links: the
daemon refuses links that lead out of its repository (``[models]
allow_external_links``), so tests hard-link the files (copy them across filesystems)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def link_file(src: Path, dst: Path) -> None:
    """``dst`` becomes the same file as ``src`` (a hard link, else a copy)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:  # another filesystem (a tmpfs /tmp) or no hard links there
        shutil.copy2(src, dst)


def link_tree(src: Path, dst: Path) -> None:
    """``dst`` becomes a directory holding the files of ``src`` (hard links, else copies)."""
    shutil.copytree(src, dst, copy_function=lambda s, d: link_file(Path(s), Path(d)))
