"""Strict modes: code the daemon loads comes only from places that only trusted users can
write (sshd's ``StrictModes``, sudo's checks of its plugins).

Code is a backend plugin (``lib<name>_backend.so``, a ``.py`` file or package), a custom
op (``*.py``, ``libinferdcst_<name>.so``, in a custom-op directory or a model's own
``customops/`` folder) and a processor file. Before any of it is opened, the file and
every folder above it up to its root (the plugin, custom-op or processors directory it
was found in; the model repository for a model's ops) must be:

- owned by root or by the daemon's own user (its effective uid), and
- writable by no one else: no write bit for others, and no write bit for the group
  unless every member of the group is root or the daemon's user (a user-private group).
  A folder with the sticky bit (``/tmp``) may be writable by others: they cannot
  rename or remove what is not theirs in it.

A file reached through a symbolic link is checked where the link points, its folders
too (up to the root if it lies inside the root, else up to ``/``); the folders that
hold the link are checked up to the root as well. Folders above the root are not
checked: the configured root is where trust is decided (a world-writable ``/tmp`` above
a test's repository does not matter). Model files (``model.onnx``) are data, not code:
they are never checked here.

``[security] strict_modes = false`` turns the checks off (development trees). Every
caller (the plugin loader, custom-op discovery, the processors) calls :meth:`check`;
what it refuses is one line naming the path, its mode, owner and group, and the rule.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
from dataclasses import dataclass
from pathlib import Path

from inferd.ipc.errors import ErrorCode, InferdError

SETTING = "[security] strict_modes"


class UntrustedCode(InferdError):
    """Code would be loaded from a place that a user other than root and the daemon's
    own can write; the message names the path, its mode and owner, and the rule."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.PERMISSION_DENIED) -> None:
        super().__init__(message, code)


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _group(gid: int) -> str:
    try:
        return f"{grp.getgrgid(gid).gr_name} (gid {gid})"
    except KeyError:
        return f"gid {gid}"


def _trusted_uids() -> set[int]:
    return {0, os.geteuid()}


def group_is_trusted(gid: int, trusted: set[int]) -> bool:
    """Whether every user of group ``gid`` (its listed members, and the users whose
    primary group it is) is one of ``trusted``."""
    try:
        members = grp.getgrgid(gid).gr_mem
    except KeyError:
        return False  # a group nobody can name: its members cannot be known
    names = set()
    for uid in trusted:
        try:
            names.add(pwd.getpwuid(uid).pw_name)
        except KeyError:
            pass
    if not set(members) <= names:
        return False
    return all(p.pw_uid in trusted for p in pwd.getpwall() if p.pw_gid == gid)


def problem(st: os.stat_result, trusted: set[int]) -> str | None:
    """Why a file or folder of this ``stat`` may hold code written by someone untrusted,
    or None."""
    if st.st_uid not in trusted:
        return "is owned by another user"
    sticky_dir = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
    if st.st_mode & stat.S_IWOTH and not sticky_dir:
        return "is writable by every user"
    if st.st_mode & stat.S_IWGRP and not sticky_dir \
            and not group_is_trusted(st.st_gid, trusted):
        return f"is writable by group {_group(st.st_gid)}"
    return None


def _chain(path: Path, root: Path) -> list[Path]:
    """``path`` and its folders up to ``root`` (both absolute, ``root`` included), or up
    to ``/`` if ``path`` is not inside ``root``."""
    if path == root:
        return [path]
    inside = root in path.parents
    out = [path]
    for parent in path.parents:
        out.append(parent)
        if inside and parent == root:
            break
    return out


@dataclass(frozen=True)
class StrictModes:
    """The policy for loaded code (see the module docstring).

    Args:
        enabled: ``[security] strict_modes``; False loads code from anywhere.
    """

    enabled: bool = True

    def check(self, path: Path, root: Path) -> None:
        """Refuse ``path`` unless it and every folder above it up to ``root`` can be
        written only by root and the daemon's own user (a no-op when not enabled).

        Args:
            path: the code file (or plugin package folder) about to be opened.
            root: the configured folder it was found under.

        Raises:
            UntrustedCode: the first file or folder that fails, with its mode, owner
                and group, and the rule.
            FileNotFoundError: ``path`` or a folder above it does not exist.
        """
        if not self.enabled:
            return
        trusted = _trusted_uids()
        path, root = Path(os.path.abspath(path)), Path(os.path.abspath(root))
        real, real_root = Path(os.path.realpath(path)), Path(os.path.realpath(root))
        # the folders that hold the name (a link there is as safe as they are), then
        # what the name leads to and the folders above it
        seen: set[Path] = set()
        for node in [*_chain(path, root)[1:], *_chain(real, real_root)]:
            if node in seen:
                continue
            seen.add(node)
            st = os.stat(node)
            why = problem(st, trusted)
            if why is not None:
                me = "root" if os.geteuid() == 0 else f"root and {_user(os.geteuid())}"
                raise UntrustedCode(
                    f"refusing to load code from {path}: {node} {why} (mode "
                    f"{stat.S_IMODE(st.st_mode):04o}, owner {_user(st.st_uid)}, group "
                    f"{_group(st.st_gid)}); code is loaded only from files and folders "
                    f"that no user but {me} can write, up to {root} ({SETTING})")

    def check_tree(self, folder: Path, root: Path) -> None:
        """:meth:`check` ``folder`` and every file and folder inside it (a plugin that is
        a Python package: any of its files may be imported).

        Raises:
            UntrustedCode: as :meth:`check`.
        """
        if not self.enabled:
            return
        self.check(folder, root)
        for top, dirs, files in os.walk(folder):
            for name in sorted(dirs + files):
                self.check(Path(top) / name, root)


STRICT = StrictModes()
"""The default: checks on (what the daemon does unless told otherwise)."""
