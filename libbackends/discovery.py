"""Plugin discovery: which files in the backends directories are candidates.

:func:`discover` lists each directory of the search path, names every entry's form
(``lib<name>_backend.so`` native, ``<name>.py`` or ``<name>/__init__.py`` Python) and
records duplicates, dangling symlinks and misnamed libraries;
:func:`_check_readable` refuses what cannot be opened without blocking. The loader
(:mod:`inferd.libbackends.loader`) takes the candidates through their stages.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from collections.abc import Sequence
from pathlib import Path

from inferd.libbackends.searchpath import list_folder
from inferd.libbackends.registry import (
    Candidate, CandidateError, CandidateStatus, Form, Stage,
)

# The loader's logger: operators filter on it (docs/backends.md quotes its lines).
log = logging.getLogger("inferd.libbackends.loader")

NATIVE_NAME = re.compile(r"lib(?P<name>[A-Za-z0-9][A-Za-z0-9_.-]*)_backend\.so")
PYTHON_NAME = re.compile(r"(?P<name>[A-Za-z][A-Za-z0-9_]*)(\.py)?")


def discover(dirs: Sequence[Path]) -> list[Candidate]:
    """Every candidate in ``dirs``, in search order and sorted within a directory.

    A second name for a file already seen is recorded as skipped; a dangling symlink
    fails at ``found``; a ``.so`` not named ``lib<name>_backend.so`` is ignored.
    """
    seen: dict[str, str] = {}
    found: list[Candidate] = []
    for d in dirs:
        for name in list_folder(d, "backends", log):
            entry = d / name
            form = _form(entry)
            if form is None:
                if name.endswith(".so") and not name.startswith("."):
                    found.append(Candidate(str(entry), Form.NATIVE, Stage.FOUND,
                                           CandidateStatus.IGNORED,
                                           "a native plugin is named lib<name>_backend.so"))
                continue
            c = Candidate(str(entry), form)
            real = os.path.realpath(entry)
            if not os.path.lexists(real) or not os.path.exists(entry):
                c.reason = f"dangling symlink to {os.readlink(entry)}"
            elif real in seen:
                c.status = CandidateStatus.SKIPPED
                c.reason = f"same file as {seen[real]}"
            else:
                seen[real] = str(entry)
            found.append(c)
    return found


def _form(entry: Path) -> Form | None:
    name = entry.name
    if name.startswith((".", "_")):
        return None
    if NATIVE_NAME.fullmatch(name):
        return Form.NATIVE
    if name.endswith(".py") and PYTHON_NAME.fullmatch(name):
        return Form.PYTHON
    if PYTHON_NAME.fullmatch(name) and (entry / "__init__.py").exists():
        return Form.PYTHON
    return None


def _check_readable(path: Path) -> None:
    """Raise CandidateError (opened) unless ``path`` is a regular file we can read.

    Checked before opening, because opening a FIFO would block."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            what = "a directory" if stat.S_ISDIR(st.st_mode) else \
                "a FIFO" if stat.S_ISFIFO(st.st_mode) else "not a regular file"
            raise CandidateError(Stage.OPENED, f"cannot read it: it is {what}")
        os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
    except OSError as e:
        raise CandidateError(Stage.OPENED, f"cannot read it: {e.strerror}") from e
