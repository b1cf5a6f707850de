#!/usr/bin/env python3
"""`make deb-test-arm64`: the arm64 packages installed in an arm64 Debian 12 root under
qemu-user, serving ocr-cls and the OCR graph with the results of the amd64 packages.

Needs root, qemu-user-static, binfmt-support, systemd-nspawn and mmdebstrap (both roots
are built once and cached, tests/packaging/make_root.sh). Steps:

1. the inputs: a fixed ocr-cls tensor and two rendered text images (one upside down,
   so the direction classifier acts);
2. amd64 reference: the amd64 packages in the amd64 root, booted with systemd as PID 1,
   the probe (tests/packaging/probe_results.py) as a user in group inferd;
3. arm64: the arm64 packages in the arm64 root, booted with systemd as PID 1 under
   qemu-user (a tmpfs-like bind holding only ``possible``/``present`` over
   /sys/devices/system/cpu, see container.py), installed with apt-get, started by
   systemd, the same probe;
4. the two results agree: ocr-cls outputs, OCR boxes and scores within 1e-4, the same
   texts. The largest differences are printed.

Usage: check_arm64.py BUILD_ROOT MODELS_DIR (make deb-test-arm64 passes build/deb, which
holds amd64/ and arm64/, and models).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))
from check_systemd import SHARE, add_users, install, make_share, MEMBER  # noqa: E402
from container import Container, cached_root  # noqa: E402

MODELS = ["ocr-cls", "ocr-det", "ocr-rec", "ocr"]
TOLERANCE = 1e-4


def step(text: str) -> None:
    print(f"deb-test-arm64: {text}", flush=True)


def make_inputs(path: Path) -> None:
    from tests.e2e.ocr_images import CASES, render

    rng = np.random.default_rng(13)
    arrays = {"cls_x": rng.standard_normal((1, 3, 48, 192)).astype(np.float32)}
    for n, case in enumerate((CASES[0], CASES[4])):
        arrays[f"image_{n}"] = render(*case)
    np.savez(path, **arrays)
    path.chmod(0o644)


def results(arch: str, build: Path, models: Path, inputs: Path) -> dict[str, np.ndarray]:
    share = make_share(build / arch, models, MODELS)
    try:
        shutil.copy2(inputs, share / "inputs.npz")
        (share / "out").mkdir(mode=0o777)
        (share / "out").chmod(0o777)
        started = time.monotonic()
        with Container(cached_root(arch), share, fake_cpu_sysfs=arch != "amd64",
                       boot_timeout=600) as c:
            step(f"{arch}: systemd is PID 1 ({c.run('cat', '/proc/1/comm').stdout.strip()}, "
                 f"{c.run('uname', '-m').stdout.strip()}), booted in {c.boot_s:.1f} s")
            restart_s = install(c, MODELS, ["ocr-cls"])
            props = c.show("inferd.service", "ActiveState", "SubState", "StatusText")
            assert (props["ActiveState"], props["SubState"]) == ("active", "running"), props
            step(f"{arch}: apt-get install, systemctl restart -> READY in {restart_s:.1f} s: "
                 f"{props['StatusText']}")
            add_users(c)
            probe_started = time.monotonic()
            out = c.run("/usr/bin/python3", f"{SHARE}/probe_results.py", f"{SHARE}/inputs.npz",
                        f"{SHARE}/out/results.npz", user=MEMBER, timeout=1800)
            print(out.stdout, end="", flush=True)
            step(f"{arch}: probe took {time.monotonic() - probe_started:.1f} s; whole "
                 f"{arch} stage {time.monotonic() - started:.0f} s")
        with np.load(share / "out" / "results.npz") as z:
            return {k: z[k] for k in z.files}
    finally:
        shutil.rmtree(share, ignore_errors=True)


def compare(ref: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> None:
    assert sorted(ref) == sorted(got), (sorted(ref), sorted(got))
    worst: dict[str, float] = {}
    for key in sorted(ref):
        a, b = ref[key], got[key]
        if key.startswith("texts_"):
            assert a.tolist() == b.tolist(), f"{key}: amd64 {a.tolist()} arm64 {b.tolist()}"
            continue
        assert a.shape == b.shape, f"{key}: amd64 {a.shape} arm64 {b.shape}"
        diff = float(np.max(np.abs(a.astype(np.float64) - b))) if a.size else 0.0
        worst[key] = diff
    text = ", ".join(f"{k} {v:.2e}" for k, v in worst.items())
    step(f"max |amd64 - arm64|: {text}")
    bad = {k: v for k, v in worst.items() if v > TOLERANCE}
    assert not bad, f"differences over {TOLERANCE}: {bad}"
    texts = [ref[k].tolist() for k in sorted(ref) if k.startswith("texts_")]
    step(f"FIGURE arm64 vs amd64: largest difference {max(worst.values()):.2e} "
         f"(tolerance {TOLERANCE}); texts equal: {texts}")


def main(argv: list[str]) -> int:
    if os.geteuid() != 0:
        print("deb-test-arm64: needs root (systemd-nspawn, binfmt)", file=sys.stderr)
        return 2
    build, models = Path(argv[1]).resolve(), Path(argv[2]).resolve()
    started = time.monotonic()
    inputs = Path("/tmp") / f"inferd-arm64-inputs-{os.getpid()}.npz"
    make_inputs(inputs)
    try:
        ref = results("amd64", build, models, inputs)
        got = results("arm64", build, models, inputs)
    finally:
        inputs.unlink(missing_ok=True)
    compare(ref, got)
    step(f"PASS in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
