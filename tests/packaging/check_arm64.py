#!/usr/bin/env python3
"""`make deb-test-arm64`: the arm64 packages installed in an arm64 Debian 12 root under
qemu-user, serving ocr-cls and the OCR graph with the results of the amd64 packages.

Needs root, qemu-user-static, binfmt-support, systemd-nspawn and mmdebstrap (both roots
are built once and cached, tests/packaging/make_root.sh). Steps:

1. the inputs: a fixed ocr-cls tensor and one rendered text image, upside down (so the
   direction classifier acts) and nearly square (cheap to detect under qemu);
2. amd64 reference: the amd64 packages in the amd64 root, booted with systemd as PID 1,
   the probe (tests/packaging/probe_results.py) as a user in group inferd;
3. arm64: the arm64 packages (and libinferd0) in the arm64 root, booted with systemd as PID 1 under
   qemu-user (a bind holding only ``possible``/``present`` over
   /sys/devices/system/cpu, see container.py), installed with apt-get, started by
   systemd with one drop-in, PrivateNetwork=no (qemu-user cannot emulate systemd's
   network namespace setup; see QEMU_DROPIN), the same probe;
4. on each, the example libinferd-dev ships, built for that architecture against that
   package (pkg-config), is served by the daemon through libinferd0;
5. the two results agree: ocr-cls outputs, OCR boxes and scores, and the libinferd
   example's scores within 1e-4, the same texts. The largest differences are printed.

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
from apt_cycle import build_against_dev  # noqa: E402
from check_systemd import MEMBER, PACKAGES, SHARE, add_users, install, make_share  # noqa: E402
from container import Container, cached_root  # noqa: E402

MODELS = ["ocr-cls", "ocr-det", "ocr-rec", "ocr"]
# The one setting of inferd.service that qemu-user cannot emulate: systemd's setup of a
# private network namespace fails there ("Failed to set up network namespacing:
# Input/output error", status 225/NETWORK). Every other setting of the unit stays; the
# whole sandbox is proven under native systemd by make deb-test-systemd.
QEMU_DROPIN = ("# qemu-user cannot emulate the network namespace setup (deb-test-arm64 only)\n"
               "[Service]\nPrivateNetwork=no\n")
TOLERANCE = 1e-4


def step(text: str) -> None:
    print(f"deb-test-arm64: {text}", flush=True)


def make_inputs(path: Path) -> None:
    """A fixed ocr-cls tensor and one OCR image: two lines, upside down (so the direction
    classifier turns every crop), nearly square (detection resizes the shorter side to
    at least 736 px, so a wide image costs minutes under qemu)."""
    from tests.e2e.ocr_images import render

    rng = np.random.default_rng(13)
    arrays = {"cls_x": rng.standard_normal((1, 3, 48, 192)).astype(np.float32),
              "image_0": render(["Hello 123", "inferd"], "DejaVuSans.ttf", 32, 180,
                                width=260)}
    np.savez(path, **arrays)
    path.chmod(0o644)


def results(arch: str, build: Path, models: Path, inputs: Path) -> dict[str, np.ndarray]:
    # inferd and the CPU add-on: the subject here (the amd64 check installs every add-on)
    share = make_share(build / arch, models, MODELS, [*PACKAGES, "libinferd0"])
    try:
        # the example libinferd-dev ships, built for ARCH against that package (issue 23)
        build_against_dev(build / arch, arch, EXAMPLE, share / "inferd_client")
        shutil.copy2(inputs, share / "inputs.npz")
        (share / "out").mkdir(mode=0o777)
        (share / "out").chmod(0o777)
        started = time.monotonic()
        with Container(cached_root(arch), share, fake_cpu_sysfs=arch != "amd64",
                       boot_timeout=600) as c:
            step(f"{arch}: systemd is PID 1 ({c.run('cat', '/proc/1/comm').stdout.strip()}, "
                 f"{c.run('uname', '-m').stdout.strip()}), booted in {c.boot_s:.1f} s")
            check_boot_units(c, arch)
            dropin = QEMU_DROPIN if arch != "amd64" else ""
            if dropin:
                step(f"{arch}: unit drop-in for qemu-user: PrivateNetwork=no (the only one)")
            restart_s = install(c, MODELS, ["ocr-cls"], dropin)
            check_package_users(c, arch)
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
            scores = libinferd_scores(c, arch)
        with np.load(share / "out" / "results.npz") as z:
            return {**{k: z[k] for k in z.files}, "libinferd_cls_scores": scores}
    finally:
        shutil.rmtree(share, ignore_errors=True)


EXAMPLE = "usr/share/doc/libinferd-dev/examples/inferd_client.c"


def libinferd_scores(c: Container, arch: str) -> np.ndarray:
    """The libinferd example (ocr-cls on a zero image, then four calls in flight) run
    against the daemon as a member of group inferd, with the libinferd0 of ARCH."""
    out = c.run(f"{SHARE}/inferd_client", "ipc:///run/inferd/inferd.sock", user=MEMBER,
                timeout=600)
    assert out.stdout.count("reply ") == 4, out.stdout + out.stderr
    scores = np.array([float(v) for v in out.stdout.split("scores:")[1].split()[:2]])
    step(f"{arch}: the libinferd example, built against libinferd-dev for {arch}, served: "
         f"scores {scores.tolist()}")
    return scores


def check_boot_units(c: Container, arch: str) -> None:
    """Under qemu-user, systemd cannot set up the credentials directory of the units that
    import credentials (systemd-sysusers, systemd-tmpfiles-setup, -setup-dev): "Failed to
    set up credentials: Invalid argument". The amd64 container boots them cleanly, so it
    is the emulation, not the container; inferd.service imports no credentials."""
    failed = c.run("systemctl", "--failed", "--no-legend", "--plain", check=False).stdout
    units = [line.split()[0] for line in failed.splitlines() if line.strip()]
    reasons = sorted({line.split(": ", 1)[-1] for line in c.journal("-b", "-p", "err").splitlines()
                      if "Failed to set up credentials" in line})
    step(f"{arch}: units failed at boot: {units or 'none'} {reasons}")


def check_package_users(c: Container, arch: str) -> None:
    """The package's sysusers.d/tmpfiles.d snippets do not depend on those boot units:
    its postinst ran systemd-sysusers and systemd-tmpfiles itself. Applied again here,
    as the boot units would, they change nothing and fail nothing."""
    c.run("getent", "passwd", "inferd")
    c.run("getent", "group", "render")
    out = c.run("systemd-sysusers", "/usr/lib/sysusers.d/inferd.conf")
    out2 = c.run("systemd-tmpfiles", "--create", "/usr/lib/tmpfiles.d/inferd.conf")
    assert not (out.stderr + out2.stderr).strip(), out.stderr + out2.stderr
    step(f"{arch}: user inferd and group render made by the package's postinst; its "
         "sysusers/tmpfiles snippets re-apply cleanly by hand")


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
