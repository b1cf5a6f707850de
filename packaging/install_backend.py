#!/usr/bin/env python3
"""Install one backend add-on into its package's build tree (called by debian/rules
for every add-on that packaging/stage_backends.py staged into debian/vendor/).

For backend ID it makes ``debian/inferd-backend-ID/usr/lib/inferd/backends/ID/``:
the plugin's Python files from ``packaging/backends/ID/`` at the top, and the staged
wheels unpacked into ``vendor/``; then, as ``packaging/backends/ID/package.toml``
says for this architecture (resolved by stage_backends.py into
``debian/vendor/backends.json``), moves each of ``docs`` to
``/usr/share/doc/inferd-backend-ID/``, removes each glob of ``prune`` (both relative
to ``vendor/``) and writes ``substvars`` to ``debian/inferd-backend-ID.substvars``.
Directories become 0755 and files 0644 (the wheels' own shared objects are loaded, not
executed).

Usage (from the source tree's root): install_backend.py ID
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import zipfile
from pathlib import Path


def install(bid: str, tree: Path) -> Path:
    source = tree / "packaging" / "backends" / bid
    spec = json.loads((tree / "debian" / "vendor" / "backends.json").read_text())[bid]
    package = tree / "debian" / f"inferd-backend-{bid}"
    dest = package / "usr" / "lib" / "inferd" / "backends" / bid
    doc = package / "usr" / "share" / "doc" / f"inferd-backend-{bid}"
    vendor = dest / "vendor"
    vendor.mkdir(parents=True, exist_ok=True)
    doc.mkdir(parents=True, exist_ok=True)
    wheels = sorted((tree / "debian" / "vendor" / bid).glob("*.whl"))
    if len(wheels) != len(spec["wheels"]):
        raise SystemExit(f"install_backend: {bid}: {len(wheels)} staged wheels for "
                         f"{spec.get('wheels')} (run make deb)")
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(vendor)
    for name in spec["docs"]:
        shutil.move(str(vendor / name), doc / Path(name).name)
    for pattern in spec["prune"]:
        matches = sorted(vendor.glob(pattern))
        if not matches:
            raise SystemExit(f"install_backend: {bid}: prune {pattern!r} matches nothing "
                             "(the wheel changed? update package.toml)")
        for path in matches:
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    for plugin in sorted(source.rglob("*.py")):
        target = dest / plugin.relative_to(source)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(plugin, target)
    if not any(vendor.iterdir()):
        vendor.rmdir()
    if not any(doc.iterdir()):
        doc.rmdir()  # dh_installdocs makes it, with the copyright file
    with open(tree / "debian" / f"inferd-backend-{bid}.substvars", "a") as f:
        for name, value in sorted(spec["substvars"].items()):
            f.write(f"{name}={value}\n")
    for root, dirs, files in os.walk(dest):
        for d in dirs:
            os.chmod(Path(root) / d, 0o755)
        for f in files:
            os.chmod(Path(root) / f, 0o644)
    return dest


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: install_backend.py ID", file=sys.stderr)
        return 2
    dest = install(argv[1], Path.cwd())
    print(f"install_backend: {argv[1]} -> {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
