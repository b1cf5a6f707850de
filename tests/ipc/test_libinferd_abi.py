"""libinferd's ABI: SONAME libinferd.so.0, only inferd_* exported and exactly what
inferd.h declares and packaging/debian/libinferd0.symbols lists, each in the version node
the symbols file names (LIBINFERD_0 for 0.1's, LIBINFERD_0.2 for the streams of 0.2), the
headers clean under strict C and C++ compilers."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.ipc import libinferd_kit as kit

HEADER = kit.LIBDIR / "include" / "inferd.h"
SYMBOLS = kit.ROOT / "packaging" / "debian" / "libinferd0.symbols"


def exported(lib: Path) -> set[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True,
                         text=True, check=True).stdout
    return {line.split()[-1] for line in out.splitlines()}


def test_soname_and_exports_match_the_header_and_the_symbols_file():
    kit.build("plain")
    lib = kit.LIBDIR / "build" / "libinferd.so.0.2.0"
    dyn = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True,
                         check=True).stdout
    assert "Library soname: [libinferd.so.0]" in dyn
    symbols = exported(lib)
    nodes = {"LIBINFERD_0", "LIBINFERD_0.2"}
    assert {s for s in symbols if not s.startswith("inferd_")} == nodes
    functions = {s.split("@")[0] for s in symbols - nodes}
    declared = set(re.findall(r"\b(inferd_\w+)\(", HEADER.read_text())) - {"inferd_release_fn"}
    assert functions == declared
    listed = dict(line.split()[0].split("@") for line in SYMBOLS.read_text().splitlines()
                  if line.startswith(" inferd_"))
    assert {s.replace("@@", "@") for s in symbols - nodes} == \
        {f"{name}@{node}" for name, node in listed.items()}
    assert {n for n, node in listed.items() if node == "LIBINFERD_0.2"} == {
        "inferd_call_set_stream", "inferd_stream_open", "inferd_stream_id",
        "inferd_stream_infer", "inferd_stream_reset", "inferd_stream_close"}
    check = subprocess.run(["make", "-s", "-C", str(kit.LIBDIR), "abi-check"],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_headers_compile_cleanly_as_c_and_cxx(short_tmp):
    for compiler, std, source in (("gcc", "-std=c11", "t.c"), ("gcc", "-std=c99", "t.c"),
                                  ("g++", "-std=c++17", "t.cpp"), ("g++", "-std=c++20", "t.cpp")):
        header = "inferd.hpp" if source.endswith("cpp") else "inferd.h"
        path = short_tmp / source
        path.write_text(f'#include "{header}"\nint main(void) {{ return 0; }}\n')
        out = subprocess.run([compiler, std, "-Wall", "-Wextra", "-Wpedantic", "-Werror",
                              f"-I{HEADER.parent}", "-fsyntax-only", str(path)],
                             capture_output=True, text=True)
        assert out.returncode == 0, f"{compiler} {std}: {out.stderr}"
