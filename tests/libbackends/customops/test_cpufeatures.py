"""CPU feature detection from /proc/cpuinfo text and AT_HWCAP words, and kernel choice."""

from __future__ import annotations

from inferd.libbackends.customops import cpufeatures as cf

X86 = "processor\t: 0\nflags\t\t: fpu sse2 ssse3 sse4_2 avx avx2 fma avx512f\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes crc32 asimdhp fphp asimddp\n"


def test_cpuinfo_flags_and_arm_aliases():
    assert {"avx2", "fma", "avx512f"} <= cf.parse_cpuinfo(X86)
    arm = cf.with_aliases(cf.parse_cpuinfo(ARM))
    assert {"neon", "dotprod", "fp16", "asimd"} <= arm and "sve" not in arm


def test_arm64_hwcap_bits():
    hw = (1 << 1) | (1 << 20) | (1 << 22)
    assert cf.hwcap_features("aarch64", hw, 1 << 1) == {"asimd", "asimddp", "sve", "sve2"}
    assert cf.hwcap_features("x86_64", hw, 0) == set()


def test_choose_takes_the_first_fitting_kernel_or_says_what_lacks():
    kernels = [("sve", "sve"), ("dot", "neon,dotprod"), ("any", "")]
    have = cf.with_aliases({"asimd", "asimddp"})
    assert cf.choose(kernels, have) == (1, "")
    assert cf.choose(kernels[:2], frozenset()) == (
        None, "no kernel fits this CPU: sve needs sve; dot needs neon, dotprod")
    assert cf.choose([], have) == (None, "the op has no kernel")


def test_detect_reads_this_cpu_once():
    assert cf.detect() is cf.detect()
    assert cf.detect()  # /proc/cpuinfo lists flags on every Linux CPU
