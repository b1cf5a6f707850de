#!/usr/bin/env python3
"""Install one backend add-on into its package's build tree (called by debian/rules
for every add-on that packaging/stage_backends.py staged into debian/vendor/).

For backend ID it makes ``debian/inferd-backend-ID/usr/lib/inferd/backends/ID/``:
the plugin's Python files from ``packaging/backends/ID/`` at the top, and the staged
wheels unpacked into ``vendor/`` (package.toml's ``plugins`` and ``vendor_dir`` may
name other directories: the onnxruntime-gpu add-on ships two plugins on one vendored
copy); then, as ``packaging/backends/ID/package.toml``
says for this architecture (resolved by stage_backends.py into
``debian/vendor/backends.json``), moves each of ``docs`` to
``/usr/share/doc/inferd-backend-ID/``, removes each glob of ``prune`` (both relative
to ``vendor/``) and writes ``substvars`` to ``debian/inferd-backend-ID.substvars``.
Directories become 0755 and files 0644 (the wheels' own shared objects are loaded, not
executed).

Usage (from the source tree's root): install_backend.py ID; ``install_backend.py
--dirs ID`` prints the add-on's plugin directories (for dh_python3),
``install_backend.py --shlibdeps-exclude`` the ``-X`` options for dh_shlibdeps of
every staged add-on and ``install_backend.py --gzip`` the ids built with gzip.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import zipfile
from pathlib import Path


BACKENDS_DIR = Path("usr") / "lib" / "inferd" / "backends"


def staged(tree: Path) -> dict[str, dict]:
    return json.loads((tree / "debian" / "vendor" / "backends.json").read_text())


def install(bid: str, tree: Path) -> Path:
    spec = staged(tree)[bid]
    package = tree / "debian" / f"inferd-backend-{bid}"
    dest = package / BACKENDS_DIR / spec["vendor_dir"]
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
    for plugin_dir, folder in sorted(spec["plugins"].items()):
        source = tree / "packaging" / "backends" / folder
        for plugin in sorted(source.rglob("*.py")):
            target = package / BACKENDS_DIR / plugin_dir / plugin.relative_to(source)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(plugin, target)
    if not any(vendor.iterdir()):
        vendor.rmdir()
    if not any(doc.iterdir()):
        doc.rmdir()  # dh_installdocs makes it, with the copyright file
    with open(tree / "debian" / f"inferd-backend-{bid}.substvars", "a") as f:
        for name, value in sorted(spec["substvars"].items()):
            f.write(f"{name}={value}\n")
    for root, dirs, files in os.walk(package / BACKENDS_DIR):
        for d in dirs:
            os.chmod(Path(root) / d, 0o755)
        for f in files:
            os.chmod(Path(root) / f, 0o644)
    return dest


def main(argv: list[str]) -> int:
    tree = Path.cwd()
    if argv[1:2] == ["--dirs"] and len(argv) == 3:
        print(*(f"/{BACKENDS_DIR}/{d}" for d in sorted(staged(tree)[argv[2]]["plugins"])))
        return 0
    if argv[1:] == ["--shlibdeps-exclude"]:
        print(*(f"-X{lib}" for spec in staged(tree).values()
                for lib in spec["shlibdeps_exclude"]))
        return 0
    if argv[1:] == ["--gzip"]:
        print(*(bid for bid, spec in staged(tree).items() if spec["compression"] == "gzip"))
        return 0
    if len(argv) != 2:
        print("usage: install_backend.py ID", file=sys.stderr)
        return 2
    dest = install(argv[1], tree)
    print(f"install_backend: {argv[1]} -> {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
