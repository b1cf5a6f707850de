"""``inferctl``: talk to a running inferd from the shell.

Readable tables by default, ``--json`` for scripts. Exit status: 0 on success, 1 when the
daemon answers with an error (its code and message go to stderr), 2 on usage errors,
141 (128 + SIGPIPE, silently, as coreutils) when the reader of its output went away
(``inferctl top --once | head -3``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np

from inferd.ipc import defs
from inferd.ipc.client import Client, default_endpoint
from inferd.ipc.dtypes import ML_DTYPES, dtype_name, numpy_dtype
from inferd.ipc.errors import ProtocolError, RequestError
from inferd.ipc.inferctl_stream import add_parser as add_stream_parser
from inferd.ipc.inferctl_stream import StreamInput, run_stream
from inferd.ipc.top import run_top


def _size(n: Any) -> str:
    if not isinstance(n, int | float):
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _table(rows: list[list[Any]], header: list[str]) -> str:
    cells = [header] + [["-" if c is None or c == "" else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def _tensors(specs: list[dict[str, Any]]) -> str:
    return ", ".join(f"{s['name']}:{s['dtype']}{s['shape']}" for s in specs) or "-"


def _cache_line(cache: dict[str, Any] | None) -> list[str]:
    if not cache:
        return []
    budget = cache["max_memory_bytes"]
    return [f"cache:    {_size(cache['used_bytes'])} used by models, budget "
            f"{_size(budget) if budget else 'unlimited'}"]


def show_status(s: dict[str, Any]) -> str:
    lines = [f"inferd {s['version']} (pid {s['pid']}) on {s['endpoint']}",
             f"ready:    {'yes' if s['ready'] else 'no'}",
             f"uptime:   {s['uptime_s']:.0f} s",
             f"memory:   {_size(s['memory']['rss_bytes'])} resident",
             *_cache_line(s.get("cache")),
             f"models:   {', '.join(s['loaded_models']) or 'none loaded'} "
             f"(repository {s['repository']})",
             "backends: " + ", ".join(f"{b['id']} ({b['kind']}, {b['status']})"
                                      for b in s["backends"])]
    if s.get("repository_problem"):
        lines.append(f"warning:  {s['repository_problem']}")
    for owner, stages in (s.get("stuck") or {}).items():  # daemon/watch.py
        lines.append(f"stuck:    {owner}: {'; '.join(stages)}")
    return "\n".join(lines)


def _ago(t: Any) -> str | None:
    if not isinstance(t, int | float):
        return None
    s = max(0.0, time.time() - t)
    return f"{s:.0f}s ago" if s < 120 else f"{s / 60:.0f}m ago" if s < 7200 \
        else f"{s / 3600:.0f}h ago"


def show_models(models: list[dict[str, Any]], verbose: bool) -> str:
    rows = []
    for m in models:
        version = m.get("version")
        if version is not None and m.get("default") is False:
            version = f"{version} (not default)"  # a named or outgoing version
        rows.append([m["name"], m["state"], version, m.get("backend"), m.get("device"),
                     _size(m.get("memory_bytes")) if m.get("memory_bytes") else None,
                     "yes" if m.get("pinned") else "no", _ago(m.get("last_used")),
                     m.get("requests", 0), m.get("error")])
    # REASON last: a failure's reason may be long.
    out = _table(rows, ["MODEL", "STATE", "VERSION", "BACKEND", "DEVICE", "MEMORY", "PINNED",
                        "LAST USED", "REQUESTS", "REASON"])
    if verbose:
        for m in models:
            if m.get("inputs"):
                threads = (f", {m['engine_threads']} engine threads"
                           if m.get("engine_threads") else "")
                out += (f"\n\n{m['name']}\n  placement: backend {m.get('backend')}, device "
                        f"{m.get('device')}{threads}; chosen: {m.get('chosen')}"
                        f"\n  inputs:  {_tensors(m['inputs'])}"
                        f"\n  outputs: {_tensors(m['outputs'])}"
                        f"\n  threads: {', '.join(m.get('threads', [])) or '-'}")
                if m.get("worker"):
                    out += f"\n  worker: {m['worker']['name']}, pid {m['worker']['pid']}"
                out += f"\n  batching: {_batching(m.get('batching'))}"
                if _has_streams(m):
                    out += f"\n  streams: {_streams(m)}"
            if m.get("kind") == "graph" and m.get("threads"):
                out += (f"\n\n{m['name']} (graph, {m['executor']} executor)"
                        f"\n  inputs:  {', '.join(m['graph_inputs'])}"
                        f"\n  outputs: {', '.join(m['graph_outputs'])}"
                        f"\n  threads: {', '.join(m['threads'])}")
            if m.get("stuck") and (m.get("inputs") or m.get("threads")):  # daemon/watch.py
                out += f"\n  stuck: {'; '.join(m['stuck'])}"
            if m.get("plan"):
                out += f"\n  plan: {len(m['plan']['steps'])} steps, {m['plan']['cuts']} cuts"
                for k, s in enumerate(m["plan"]["steps"]):
                    detail = f" [{s['detail']}]" if s.get("detail") else ""
                    out += (f"\n    step {k}: {s['executor']}{detail}: "
                            f"{', '.join(s['nodes'])} ({', '.join(s['inputs'])} -> "
                            f"{', '.join(s['outputs'])})")
            for p in m.get("placement", []):
                out += (f"\n    {p['thread']}: stage {p['stage']}, native id {p['native_id']}, "
                        f"cpus {_cores(p['affinity'])}, backend {p['backend'] or '-'}"
                        + (f" ({p['error']})" if p.get("error") else ""))
    return out


def _has_streams(m: dict[str, Any]) -> bool:
    """A model with a [stream] table, or streams counted (docs/streams.md)."""
    return bool(m.get("stream") or m.get("streams") or m.get("streams_expired")
                or m.get("streams_lost"))


def _streams(m: dict[str, Any]) -> str:
    spec = m.get("stream") or {}
    line = (f"{m.get('streams', 0)} open ({_size(m.get('streams_bytes', 0))} of state); "
            f"since the start {m.get('streams_expired', 0)} freed idle, "
            f"{m.get('streams_lost', 0)} lost")
    if spec.get("max_streams") is not None:
        line += f"; max_streams {spec['max_streams']}, idle_timeout_s {spec['idle_timeout_s']:g}"
    return line


def _batching(b: dict[str, Any] | None) -> str:
    if not b or b.get("max_batch", 1) <= 1:
        return "off"
    line = f"on (max_batch {b['max_batch']}, max_delay_ms {b['max_delay_ms']:g})"
    if b.get("mode") == "adaptive" and "limit" in b:  # loaded: what it measured
        costs = ", ".join(f"{ms:g} ms at {n}" for n, ms in b.get("cost_per_row_ms", {}).items())
        line += (f"; adaptive: batches of up to {b['limit']} rows"
                 + (f" (probing {b['probing'][0]} vs {b['probing'][1]})" if b.get("probing")
                    else "") + f"; {b.get('why')}" + (f"; cost per row {costs}" if costs else ""))
    elif b.get("mode"):
        line += f"; {b['mode']}"
    return line


def show_reload(r: dict[str, Any]) -> str:
    lines = [f"{kind}: {', '.join(r[kind])}" for kind in
             ("added", "removed", "changed", "failed", "graphs_retired", "needs_restart",
              "remeasured")
             if r.get(kind)]
    return "\n".join(lines) or "reloaded: nothing changed"


def _cores(cores: list[int]) -> str:
    return ",".join(map(str, cores)) if cores else "-"


def show_backends(b: dict[str, Any]) -> str:
    rows = [[x["id"], ",".join(x.get("kinds") or [x["kind"]]), x["version"], x["status"],
             ", ".join(x.get("devices", [])),
             x.get("source"), x.get("reason")] for x in b["backends"]]
    out = _table(rows, ["BACKEND", "KIND", "VERSION", "STATUS", "DEVICES", "SOURCE", "REASON"])
    if b.get("candidates"):
        rows = [[c["path"], c["form"], c["stage"], c["status"], c.get("backend"),
                 c.get("reason")] for c in b["candidates"]]
        out += "\n\n" + _table(rows, ["CANDIDATE", "FORM", "STAGE", "STATUS", "BACKEND",
                                       "REASON"])
    if b.get("models"):
        rows = [[m["name"], m.get("version"), m["backend"], m.get("device"), m.get("chosen")]
                for m in b["models"]]
        out += "\n\n" + _table(rows, ["MODEL", "VERSION", "BACKEND", "DEVICE", "CHOSEN"])
    if b.get("search_path") is not None:
        source = f" (from {b['search_path_source']})" if b.get("search_path_source") else ""
        out += "\n\nsearch path: " + (":".join(b["search_path"]) or "(none)") + source
    ops = b.get("customops")
    if ops:
        rows = [[o["op_type"], o["domain"] if o["domain"] is not None else "(any)",
                 o["kind"], o.get("kernel") or o.get("reason"), o["source"]]
                for o in ops["ops"]]
        out += "\n\n" + _table(rows, ["CUSTOM OP", "DOMAIN", "KIND", "KERNEL", "SOURCE"])
        if ops["skipped"]:
            rows = [[s["path"], s["stage"], s["reason"]] for s in ops["skipped"]]
            out += "\n\n" + _table(rows, ["SKIPPED OP FILE", "STAGE", "REASON"])
        source = f" (from {ops['search_path_source']})" if ops.get("search_path_source") \
            else ""
        out += "\n\ncustom ops search path: " + (":".join(ops["search_path"]) or "(none)") \
            + source
    return out


def _wait(args: argparse.Namespace) -> int:
    deadline = time.monotonic() + args.timeout
    last = "daemon not reachable"
    while time.monotonic() < deadline:
        try:
            with Client(args.socket, timeout=min(2.0, max(0.1, deadline - time.monotonic()))) as c:
                if c.ping()["ready"]:
                    if not args.json:
                        print("ready")
                    return 0
                last = "daemon is up but not ready yet"
        except RequestError as e:
            last = e.message
        time.sleep(0.1)
    print(f"inferctl: not ready after {args.timeout} s: {last}", file=sys.stderr)
    return 1


IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".webp"}


def _load_input(path: str) -> np.ndarray:
    """A .npy file as saved, or an image file as uint8 HxWx3 BGR (OpenCV's order, what
    the OCR graph takes), decoded with OpenCV or else Pillow."""
    if Path(path).suffix.lower() not in IMAGE_SUFFIXES:
        try:
            return np.load(path, allow_pickle=False)
        except OSError as e:
            raise SystemExit(f"inferctl: cannot read {path}: {e.strerror or e}") from None
        except (ValueError, EOFError) as e:  # not .npy, truncated, or pickled objects
            why = ("not a plain .npy array (inferctl never loads pickled Python objects)"
                   if "allow_pickle" in str(e) else f"not a valid .npy file ({e})")
            raise SystemExit(f"inferctl: cannot read {path}: {why}") from None
    try:
        import cv2
    except ImportError:
        cv2 = None  # type: ignore[assignment]
    if cv2 is not None:
        img = cv2.imread(path, cv2.IMREAD_COLOR)
        if img is None:
            raise SystemExit(f"inferctl: cannot decode image {path}")
        return img
    try:
        from PIL import Image
    except ImportError:
        raise SystemExit(f"inferctl: reading {path} needs OpenCV or Pillow") from None
    with Image.open(path) as im:
        return np.ascontiguousarray(np.array(im.convert("RGB"))[:, :, ::-1])


def _as_dtype(array: np.ndarray, dtype: str, path: str) -> np.ndarray:
    """``array``'s bytes read as wire dtype ``dtype`` (``-i x=FILE.npy:bfloat16``): numpy
    saves ml_dtypes' arrays as raw void items (``|V2``), or a file holds bit patterns."""
    try:
        target = numpy_dtype(dtype)
    except ProtocolError as e:
        raise SystemExit(f"inferctl: {path}: {e.message}") from None
    if array.dtype.itemsize != target.itemsize:
        raise SystemExit(f"inferctl: {path} holds {array.dtype} items of "
                         f"{array.dtype.itemsize} bytes; {dtype} has {target.itemsize}")
    return np.ascontiguousarray(array).view(target)


def _inputs(args: argparse.Namespace) -> dict[str, np.ndarray]:
    """The ``-i NAME=FILE[:DTYPE]`` inputs, read before connecting (SystemExit with one
    line)."""
    inputs = {}
    for spec in args.input:
        name, sep, path = spec.partition("=")
        if not sep:
            raise SystemExit(f"inferctl: -i expects NAME=FILE.npy, got {spec!r}")
        file, colon, dtype = path.rpartition(":")
        if colon and dtype in ML_DTYPES:
            inputs[name] = _as_dtype(_load_input(file), dtype, file)
        else:
            inputs[name] = _load_input(path)
    return inputs


def _plain(value: np.ndarray) -> np.ndarray:
    """``value`` in a type that prints and saves as itself: ml_dtypes' floats as float32,
    their 2- and 4-bit integers as int8/uint8."""
    name = dtype_name(value) if value.dtype != object else ""
    if name not in ML_DTYPES:
        return value
    if name in ("int4", "uint4", "int2", "uint2"):
        return value.astype(np.int8 if name.startswith("int") else np.uint8)
    return value.astype(np.float32)


def _infer(c: Client, args: argparse.Namespace, inputs: dict[str, np.ndarray]) -> None:
    outputs = c.infer(args.model, inputs, args.output_names)
    if args.out_dir:
        Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    for name, value in outputs.items():
        saved = ""
        if args.out_dir:
            path = Path(args.out_dir) / (name.replace("/", "_") + ".npy")
            wire = dtype_name(value) if value.dtype != object else ""
            if wire in ML_DTYPES:  # np.save would write raw void items: keep the bits
                bits = value.view(np.uint16 if value.dtype.itemsize == 2 else np.uint8)
                np.save(path, bits)
                saved = (f" (its {bits.dtype} bit patterns: read it back with "
                         f"np.load(f).view(ml_dtypes.{wire}), or -i {name}={path}:{wire})")
            else:
                np.save(path, value, allow_pickle=value.dtype == object)
        if args.json:
            continue
        if value.dtype == object:
            print(f"{name}:")
            for item in value.reshape(-1):
                print(f"  {item}")
        else:
            where = f" -> {path}{saved}" if args.out_dir else ""
            print(f"{name}: {value.dtype}{list(value.shape)}{where}")
            if value.size <= 16:
                print(f"  {_plain(value).tolist()}")
    if args.json:
        print(json.dumps({k: (_plain(v).tolist() if v.size <= 4096 or v.dtype == object
                              else {"dtype": str(v.dtype), "shape": list(v.shape)})
                          for k, v in outputs.items()}))


def _version() -> str:
    try:
        return version("inferd")
    except PackageNotFoundError:  # a source tree that is not installed
        return "0+unknown"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="inferctl", description="Control and query inferd.")
    p.add_argument("--socket", default=None, help=f"daemon endpoint (default ${defs.SOCKET_ENV} "
                   f"or {defs.SOCKET})")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--version", action="version", version=f"inferctl {_version()}")
    p.add_argument("--timeout", type=float, default=30.0, dest="request_timeout",
                   help="seconds to wait for a reply (default 30)")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("status", help="daemon version, readiness, memory, backends")
    m = sub.add_parser("models", help="every model and its state")
    m.add_argument("--verbose", "-v", action="store_true", help="tensors and threads too")
    sub.add_parser("backends", help="every backend candidate, its stage and reason")
    sub.add_parser("ping", help="check the daemon answers")
    r = sub.add_parser("reload", help="re-read the config and the model repository "
                       "(like SIGHUP)")
    r.add_argument("--remeasure", nargs="*", metavar="MODEL", default=None,
                   help="forget the measured placement of these models (none named: of "
                   "every model) and measure the loaded ones again")
    for name in ("load", "unload"):
        c = sub.add_parser(name, help=f"{name} a model")
        c.add_argument("model")
        c.add_argument("--version", type=int, default=None)
    t = sub.add_parser("top", help="a live table of the models: requests, latency, "
                       "queues, memory (refreshed each second)")
    t.add_argument("--once", action="store_true", help="print the table once and exit")
    t.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    sub.add_parser("metrics", help="the daemon's metrics in Prometheus text format")
    w = sub.add_parser("wait", help="wait until the daemon is ready")
    w.add_argument("--timeout", type=float, default=30.0)
    i = sub.add_parser("infer", help="run a model on .npy inputs")
    i.add_argument("model")
    i.add_argument("-i", "--input", action="append", default=[],
                   metavar="NAME=FILE[:DTYPE]",
                   help="an input: a .npy file, or an image (.png, .jpg...) as uint8 BGR; "
                        ":bfloat16, :float8_e4m3fn, :int4... reads a .npy's items as that "
                        "type")
    i.add_argument("-o", "--out-dir", default=None, help="write each output as NAME.npy")
    i.add_argument("--output", action="append", dest="output_names", default=None,
                   help="only this output (repeatable)")
    add_stream_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """The ``inferctl`` command; returns its exit status."""
    try:
        try:
            return _main(argv)
        finally:  # also after argparse's --help: a closed pipe is caught here, not at exit
            sys.stdout.flush()
    except BrokenPipeError:
        return _stdout_closed()


def _stdout_closed() -> int:
    # Python ignores SIGPIPE, so writing to a pipe whose reader is gone raises instead of
    # ending the process as it ends `cat`; end quietly like cat, and point stdout at
    # /dev/null so that the interpreter's own flush at exit does not raise again.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    args.socket = args.socket or default_endpoint()
    if args.cmd == "wait":
        return _wait(args)
    inputs = _inputs(args) if args.cmd == "infer" else {}
    source = StreamInput(args) if args.cmd == "stream" else None
    try:
        with Client(args.socket, timeout=args.request_timeout) as c:
            if args.cmd == "infer":
                _infer(c, args, inputs)
                return 0
            if source is not None:
                return run_stream(c, args, source)
            if args.cmd == "top":
                return run_top(c, once=args.once, interval=args.interval,
                               as_json=args.json)
            if args.cmd == "metrics":
                metrics = c.call("metrics")
                print(json.dumps(metrics, indent=2) if args.json else metrics["text"],
                      end="" if not args.json else "\n")
                return 0
            if args.cmd == "status":
                result: Any = c.status()
                text = show_status(result) if not args.json else ""
            elif args.cmd == "models":
                result = c.models(verbose=args.verbose or None)
                text = show_models(result, args.verbose) if not args.json else ""
            elif args.cmd == "backends":
                result = c.backends()
                text = show_backends(result) if not args.json else ""
            elif args.cmd == "ping":
                result = c.ping()
                text = "pong" + ("" if result["ready"] else " (not ready)")
            elif args.cmd == "reload":
                remeasure = args.remeasure
                result = c.call("reload", remeasure=None if remeasure is None
                                else (remeasure or True))
                text = show_reload(result) if not args.json else ""
            elif args.cmd == "load":
                result = c.load(args.model, args.version)
                text = f"{args.model}: {result['state']} (version {result['version']}, " \
                       f"backend {result['backend']})"
            else:
                result = c.call("unload", args.model, version=args.version)
                text = f"{args.model}: {result['state']}"
    except RequestError as e:
        print(f"inferctl: {e.code}: {e.message}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        raise  # an OSError, but not the daemon's: main() ends quietly
    except OSError as e:
        print(f"inferctl: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2) if args.json else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
