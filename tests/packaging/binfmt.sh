#!/usr/bin/env bash
# Makes this x86_64 machine run aarch64 binaries through qemu-user-static (binfmt_misc
# with the F flag: the kernel keeps the interpreter open, so a root need not contain
# qemu). binfmt_misc is not mounted at boot on a fresh Debian 12 CI machine; the
# registration is lost on reboot, so this runs before every arm64 step. Needs root,
# qemu-user-static and binfmt-support.
set -euo pipefail
if [ ! -e /proc/sys/fs/binfmt_misc/status ]; then
    mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
fi
if [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
    update-binfmts --enable qemu-aarch64
fi
grep -q '^flags: .*F' /proc/sys/fs/binfmt_misc/qemu-aarch64 || {
    echo "binfmt: qemu-aarch64 is registered without the F flag" >&2; exit 1; }
grep -q '^enabled' /proc/sys/fs/binfmt_misc/qemu-aarch64
