"""Bounded parsing of a message's JSON header: nothing a client writes can make the
parser recurse, allocate or compute in proportion to its claims.

The limits are checked on the raw bytes before or while ``json.loads`` runs:

* a request header is at most :data:`MAX_HEADER_BYTES` (a reply header is not bounded:
  it comes from the daemon);
* arrays and objects nest at most :data:`MAX_DEPTH` deep (a pre-scan of the bytes,
  so the C parser never recurses far enough to raise RecursionError);
* an integer has at most :data:`MAX_INT_DIGITS` digits and a float must be finite
  (``1e400`` is refused, not turned into ``inf``); ``NaN`` and ``Infinity``, which
  Python's parser accepts by default, are refused.

A number or constant that breaks a limit does not stop the parse: it is recorded and
:func:`parse` raises once the header is read, so the error can carry the request's id.
When the header cannot be parsed at all, :func:`first_key_id` recovers the id with one
bounded regular expression if ``"id"`` is the header's first key (as every inferd
client writes it), and that is all that is ever read of such a header.
"""

from __future__ import annotations

import json
import math
import re
import threading
from typing import Any

from inferd.ipc.errors import ProtocolError

MAX_HEADER_BYTES = 65536
"""Largest request header (UTF-8 bytes of the JSON)."""
MAX_DEPTH = 32
"""Deepest nesting of arrays and objects in a header."""
MAX_INT_DIGITS = 20
"""Most digits of an integer in a header (int64 and uint64 need at most 20)."""
MAX_ID_CHARS = 256
"""Longest request id."""

# A string (an unterminated one runs to the end: one pass, no backtracking) or a bracket.
_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"?|[\[\]{}]', re.DOTALL)
_FIRST_ID = re.compile(rb'\A\s*\{\s*"id"\s*:\s*"((?:[^"\\\x00-\x1f]|\\.){1,%d})"'
                       % MAX_ID_CHARS)
_problems = threading.local()


class HeaderError(ProtocolError):
    """A header that breaks a bound or is not JSON; ``request_id`` is set when known."""


def _note(problem: str) -> None:
    found: list[str] | None = getattr(_problems, "found", None)
    if found is not None and len(found) < 4:
        found.append(problem)


def _int(text: str) -> int:
    if len(text) - text.startswith("-") > MAX_INT_DIGITS:
        _note(f"an integer of {len(text)} digits (at most {MAX_INT_DIGITS} are allowed)")
        return 0
    return int(text)


def _float(text: str) -> float:
    if len(text) > 64:
        _note(f"a number written with {len(text)} characters (at most 64)")
        return 0.0
    value = float(text)
    if not math.isfinite(value):
        _note(f"the number {text[:32]} is out of range")
        return 0.0
    return value


def _constant(text: str) -> float:
    _note(f"{text} is not a JSON number")
    return 0.0


_DECODER = json.JSONDecoder(parse_int=_int, parse_float=_float, parse_constant=_constant)
# Without the integer hook (a Python call per integer): for a header that has no run of
# more digits than an integer may have, where the hook could find nothing.
_PLAIN_INTS = json.JSONDecoder(parse_float=_float, parse_constant=_constant)
_LONG_DIGITS = re.compile(rb"[0-9]{%d}" % (MAX_INT_DIGITS + 1))
# The decoders' scanners (text, index) -> (value, end): decode() adds two Python frames
# and two regular-expression matches around them.
_SCANS = {_DECODER: _DECODER.scan_once,  # type: ignore[attr-defined]
          _PLAIN_INTS: _PLAIN_INTS.scan_once}  # type: ignore[attr-defined]


def depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in the JSON ``raw`` (strings ignored)."""
    opens = raw.count(b"[") + raw.count(b"{")
    if opens <= MAX_DEPTH:  # cheap bound: nesting can never exceed the bracket count
        return opens
    deepest = level = 0
    for token in _TOKENS.findall(raw):
        if token in (b"[", b"{"):
            level += 1
            deepest = max(deepest, level)
        elif token in (b"]", b"}"):
            level -= 1
    return deepest


def first_key_id(raw: bytes) -> str | None:
    """The request id if it is the header's first key; a bounded regex, no parse."""
    m = _FIRST_ID.match(raw[:MAX_ID_CHARS * 6 + 64])
    if m is None:
        return None
    try:
        rid = json.loads(b'"' + m.group(1) + b'"')
    except ValueError:
        return None
    return rid if isinstance(rid, str) else None


def parse(raw: bytes, kind: str, max_bytes: int | None = MAX_HEADER_BYTES) -> dict[str, Any]:
    """Parse a header within the bounds; raises :class:`HeaderError` (INVALID_ARGUMENT).

    Args:
        raw: the header frame's bytes.
        kind: "request" or "reply", for messages.
        max_bytes: the size bound (None: unbounded, for replies).
    """
    if max_bytes is not None and len(raw) > max_bytes:
        raise HeaderError(f"{kind} header is {len(raw)} bytes; at most {max_bytes} are "
                          f"allowed", request_id=first_key_id(raw))
    nesting = depth(raw)
    if nesting > MAX_DEPTH:
        raise HeaderError(f"{kind} header nests {nesting} levels deep; at most {MAX_DEPTH} "
                          f"are allowed", request_id=first_key_id(raw))
    found: list[str] = []
    _problems.found = found
    try:
        # Decoded first: json.loads on bytes would guess the encoding each time.
        decoder = _DECODER if _LONG_DIGITS.search(raw) else _PLAIN_INTS
        text = raw.decode("utf-8")
        try:
            header, end = _SCANS[decoder](text, 0)
        except StopIteration:  # leading whitespace, or not JSON: decode() says which
            header, end = decoder.decode(text), len(text)
        if end != len(text):  # trailing whitespace is allowed, anything else refused
            found.clear()
            header = decoder.decode(text)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise HeaderError(f"{kind} header is not valid UTF-8 JSON: {e}",
                          request_id=first_key_id(raw)) from None
    finally:
        _problems.found = None
    if not isinstance(header, dict):
        raise HeaderError(f"{kind} header must be a JSON object")
    if found:
        rid = header.get("id")
        raise HeaderError(f"{kind} header has {'; '.join(found)}",
                          request_id=rid if isinstance(rid, str) else None)
    return header
