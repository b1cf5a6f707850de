#!/usr/bin/env python3
"""Stage every backend add-on of packaging/backends/ into a source tree for one
architecture (called by packaging/build-deb.sh, before dpkg-buildpackage).

A backend add-on is a folder ``packaging/backends/<id>/`` holding:

- ``control``: the binary package's stanza (``Package: inferd-backend-<id>``); its
  ``Architecture:`` field lists the Debian architectures the add-on is built for;
- ``package.toml``: ``wheels`` (pip requirements pinned with ``==``, vendored into the
  plugin's ``vendor/``, fetched without dependencies), optional ``docs`` and ``prune``
  (paths and globs inside ``vendor/``, see packaging/install_backend.py) and
  ``substvars`` (``{"name:Depends" = "..."}`` for the control stanza),
  ``shlibdeps_exclude`` (vendored libraries dh_shlibdeps skips: optional device
  plugins linking what only the device's own stack provides); a table
  ``[arch.<debian-arch>]`` adds its own of these for one architecture only; and, for
  all architectures, ``compression`` (``"gzip"`` for large engines; default xz),
  ``vendor_dir`` (the plugin directory whose ``vendor/`` gets the wheels; default the
  id) and ``plugins`` (``{dir = "folder"}``: each plugin directory under
  /usr/lib/inferd/backends and the folder of packaging/backends/ whose Python files it
  holds; default ``{<id> = "<id>"}``);
- ``copyright``: the DEP-5 ``Files: debian/vendor/<id>/*`` paragraph of what it vendors;
- optional ``lintian-overrides`` (each with its reason in a comment) and
  ``README.Debian``;
- the plugin itself: its Python files (``__init__.py`` with ``create_backend()``).

For each add-on built for ARCH, the wheels are downloaded once into
``CACHE/<id>/`` (the package build itself needs no network) and copied to
``debian/vendor/<id>/``; the stanza is appended to ``debian/control``, the copyright
paragraph to ``debian/copyright``, the overrides and README.Debian become
``debian/inferd-backend-<id>.*``, and the add-on's settings for ARCH are added to
``debian/vendor/backends.json``, which debian/rules and install_backend.py read. An
add-on whose control does not list ARCH, or whose upstream publishes no wheel for it
(pip finds none), is skipped with the reason printed; any other pip failure (network,
typo) fails the build.

``$INFERD_DEB_BACKENDS`` (space-separated ids), when set, stages only those add-ons.

Usage: stage_backends.py ARCH SOURCE_TREE CACHE PIP_PYTHON
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent
BACKENDS = HERE / "backends"
# Debian architecture -> wheel machine; glibc of Debian 12 is 2.36 and pip does not
# widen an explicit --platform to older manylinux tags, so every tag is listed.
MACHINES = {"amd64": "x86_64", "arm64": "aarch64"}
GLIBC_MINOR = 36
PACKAGE_RE = re.compile(r"^Package:\s*(\S+)\s*$", re.M)
ARCH_RE = re.compile(r"^Architecture:\s*(.+)$", re.M)
NO_WHEEL = ("No matching distribution found", "Could not find a version that satisfies")


def say(text: str) -> None:
    print(f"stage_backends: {text}", flush=True)


def platforms(machine: str) -> list[str]:
    tags = [f"manylinux_2_{minor}_{machine}" for minor in range(GLIBC_MINOR, 16, -1)]
    return tags + [f"manylinux2014_{machine}", f"linux_{machine}"]


def python_tag() -> tuple[str, str]:
    """The Debian python3 the packages are for (3.11 on Debian 12): ("3.11", "cp311")."""
    major, minor = sys.version_info[:2]
    return f"{major}.{minor}", f"cp{major}{minor}"


def wheel_names(requirement: str) -> tuple[str, str]:
    name, _, version = requirement.partition("==")
    if not version:
        raise SystemExit(f"stage_backends: pin wheels exactly (name==version): {requirement}")
    return name.strip().replace("-", "_").lower(), version.strip()


def cached_wheel(cache: Path, requirement: str, machine: str) -> Path | None:
    name, version = wheel_names(requirement)
    for wheel in sorted(cache.glob("*.whl")):
        parts = wheel.name.lower().split("-")
        if parts[0] == name and parts[1] == version and wheel.name.endswith(
                (f"_{machine}.whl", "-none-any.whl")):
            return wheel
    return None


def fetch(cache: Path, requirement: str, machine: str, pip_python: str) -> Path | str:
    """The wheel for REQUIREMENT on MACHINE, or the reason pip gives for having none."""
    found = cached_wheel(cache, requirement, machine)
    if found is not None:
        return found
    cache.mkdir(parents=True, exist_ok=True)
    pyver, abi = python_tag()
    cmd = [pip_python, "-m", "pip", "download", "--quiet", "--no-deps",
           "--only-binary", ":all:", "--implementation", "cp", "--python-version", pyver,
           "--abi", abi, "--abi", "abi3", "--abi", "none", "-d", str(cache)]
    for tag in platforms(machine):
        cmd += ["--platform", tag]
    out = subprocess.run([*cmd, requirement], capture_output=True, text=True)
    if out.returncode != 0:
        text = out.stdout + out.stderr
        if any(marker in text for marker in NO_WHEEL):
            return (f"upstream publishes no {requirement} wheel for {machine} and "
                    f"CPython {pyver} (pip: no matching distribution)")
        raise SystemExit(f"stage_backends: pip download {requirement} failed:\n{text}")
    found = cached_wheel(cache, requirement, machine)
    if found is None:
        raise SystemExit(f"stage_backends: pip downloaded no {requirement} wheel into {cache}")
    return found


KEYS = ("wheels", "docs", "prune", "substvars", "shlibdeps_exclude")
GLOBAL_KEYS = ("compression", "vendor_dir", "plugins")
PLUGIN_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")  # what the daemon's loader imports


def settings(spec: dict[str, object], arch: str, bid: str = "") -> dict[str, object]:
    """package.toml's settings for ARCH: the top level plus its [arch.ARCH] table (BID:
    the add-on's id, the default plugin and vendor directory)."""
    unknown = set(spec) - set(KEYS) - set(GLOBAL_KEYS) - {"arch"}
    per_arch = spec.get("arch", {})
    assert isinstance(per_arch, dict)
    extra = per_arch.get(arch, {})
    unknown |= set(extra) - set(KEYS)
    if unknown:
        raise SystemExit(f"stage_backends: unknown package.toml keys {sorted(unknown)}")
    out: dict[str, object] = {}
    for key in ("wheels", "docs", "prune", "shlibdeps_exclude"):
        out[key] = list(spec.get(key, [])) + list(extra.get(key, []))  # type: ignore[call-overload]
    # every substvar that any architecture sets is defined (empty where not set), so
    # that the control stanza can use it everywhere
    subst = {name: "" for table in per_arch.values() for name in table.get("substvars", {})}
    subst.update(spec.get("substvars", {}))  # type: ignore[arg-type]
    subst.update(extra.get("substvars", {}))
    out["substvars"] = subst
    plugins = spec.get("plugins", {bid: bid} if bid else {})
    assert isinstance(plugins, dict)
    bad = [d for d in plugins if not PLUGIN_NAME.fullmatch(d)]
    if bad or (bid and not plugins):
        raise SystemExit(f"stage_backends: {bid}: plugin directories must be Python "
                         f"identifiers (the loader skips others): {bad or 'none given'} "
                         "(set plugins in package.toml)")
    out["plugins"] = plugins
    out["vendor_dir"] = spec.get("vendor_dir", bid)
    out["compression"] = spec.get("compression", "xz")
    if out["compression"] not in ("xz", "gzip"):
        raise SystemExit(f"stage_backends: {bid}: compression must be xz or gzip")
    return out


def insert_copyright(copyright_file: Path, paragraph: str) -> None:
    """Add a Files paragraph before the first standalone License paragraph."""
    text = copyright_file.read_text()
    paragraphs = text.rstrip("\n").split("\n\n")
    at = next((i for i, p in enumerate(paragraphs) if p.startswith("License:")),
              len(paragraphs))
    paragraphs.insert(at, paragraph.strip("\n"))
    copyright_file.write_text("\n\n".join(paragraphs) + "\n")


def stage(backend: Path, arch: str, debian: Path, cache: Path, pip_python: str) -> str:
    """Stage one add-on; returns what was done (or why it was skipped)."""
    bid = backend.name
    control = (backend / "control").read_text()
    package = PACKAGE_RE.search(control)
    if package is None or package.group(1) != f"inferd-backend-{bid}":
        raise SystemExit(f"stage_backends: {backend}/control must be Package: "
                         f"inferd-backend-{bid}")
    arches = ARCH_RE.search(control)
    listed = arches.group(1).split() if arches else []
    if arch not in listed:
        return f"skip inferd-backend-{bid} for {arch}: its control lists only {listed}"
    if arch not in MACHINES:
        return f"skip inferd-backend-{bid} for {arch}: no wheel platform known for {arch}"
    spec = settings(tomllib.loads((backend / "package.toml").read_text()), arch, bid)
    wheels: list[Path] = []
    for requirement in spec["wheels"]:  # type: ignore[attr-defined]
        got = fetch(cache / bid, requirement, MACHINES[arch], pip_python)
        if isinstance(got, str):
            return f"skip inferd-backend-{bid} for {arch}: {got}"
        wheels.append(got)
    vendor = debian / "vendor" / bid
    vendor.mkdir(parents=True, exist_ok=True)
    for wheel in wheels:
        shutil.copy2(wheel, vendor / wheel.name)
    with open(debian / "control", "a") as f:
        f.write("\n" + control.strip("\n") + "\n")
    insert_copyright(debian / "copyright", (backend / "copyright").read_text())
    for name in ("lintian-overrides", "README.Debian"):
        if (backend / name).exists():
            shutil.copy2(backend / name, debian / f"inferd-backend-{bid}.{name}")
    index = debian / "vendor" / "backends.json"
    staged = json.loads(index.read_text()) if index.exists() else {}
    staged[bid] = spec
    index.write_text(json.dumps(staged, indent=1, sort_keys=True) + "\n")
    return f"inferd-backend-{bid} for {arch}: {', '.join(w.name for w in wheels) or 'no wheels'}"


def main(argv: list[str]) -> int:
    if len(argv) != 5:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    arch, tree, cache, pip_python = argv[1], Path(argv[2]), Path(argv[3]), argv[4]
    debian = tree / "debian"
    (debian / "vendor").mkdir(parents=True, exist_ok=True)
    (debian / "vendor" / "backends.json").write_text("{}\n")
    staged = 0
    only = os.environ.get("INFERD_DEB_BACKENDS")
    for backend in sorted(p for p in BACKENDS.iterdir() if (p / "control").exists()):
        if only is not None and backend.name not in only.split():
            say(f"skip inferd-backend-{backend.name}: not in $INFERD_DEB_BACKENDS ({only})")
            continue
        result = stage(backend, arch, debian, cache.resolve(), pip_python)
        staged += not result.startswith("skip ")
        say(result)
    say(f"{staged} add-on(s) staged for {arch}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
