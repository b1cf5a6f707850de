"""``inferctl stream``: a 16-bit PCM WAV file (or one arriving on stdin, ``arecord``'s)
through a model's stream (docs/streams.md), chunk by chunk: each chunk's outputs, and,
where each reply is one probability (Silero VAD's ``output``), speech segments by
silero-vad's rules (:mod:`inferd.ipc.speech`) as soon as each is final.

The audio goes in as float32 samples / 32768, shape [1, CHUNK] (what silero-vad's own
``read_audio`` and ``OnnxWrapper`` give the model); the daemon carries the state and the
context between chunks. A last partial chunk is zero-padded to CHUNK samples, as
silero-vad's ``get_speech_timestamps`` does, and the segments end at the audio's real
length.
"""

from __future__ import annotations

import argparse
import json
import sys
import wave
from collections.abc import Iterator
from typing import Any, BinaryIO

import numpy as np

from inferd.ipc.client import Client
from inferd.ipc.speech import Segment, SpeechRules, SpeechSegmenter


def add_parser(sub: Any) -> None:
    """The ``stream`` subcommand's arguments, on inferctl's subparsers ``sub``."""
    s = sub.add_parser("stream", help="stream a 16-bit PCM WAV through a model's stream, "
                       "chunk by chunk (the daemon keeps the state); speech segments for a "
                       "voice activity detector")
    s.add_argument("model")
    s.add_argument("-i", "--input", required=True, metavar="NAME=FILE.wav",
                   help="the streamed input and a mono 16-bit PCM WAV file ('-': stdin, "
                        "e.g. arecord -f S16_LE -r 16000 -c 1 | inferctl stream vad -i "
                        "input=-)")
    s.add_argument("--chunk", type=int, default=512,
                   help="samples per request (default 512: Silero VAD at 16 kHz)")
    s.add_argument("--sr", type=int, default=16000,
                   help="the sample rate the model takes (default 16000); a WAV of another "
                        "rate is refused; sent as the constant input 'sr' when the model "
                        "has one")
    s.add_argument("-c", "--const", action="append", default=[], metavar="NAME=VALUE",
                   help="another constant input of the stream: an integer (int64), a number "
                        "(float32) or a .npy file (repeatable)")
    s.add_argument("--id", default=None, help="the stream's id (default: the client's own)")
    s.add_argument("--no-chunks", action="store_true",
                   help="print no line per chunk, only the segments and the summary")
    s.add_argument("--threshold", type=float, default=0.5,
                   help="speech at or above this probability (silero's default 0.5; its "
                        "exit threshold is this - 0.15)")
    s.add_argument("--min-speech-ms", type=float, default=250,
                   help="drop segments this short or shorter (default 250)")
    s.add_argument("--min-silence-ms", type=float, default=100,
                   help="the silence that ends a segment (default 100)")
    s.add_argument("--pad-ms", type=float, default=30,
                   help="padding on each side of a segment (default 30)")


class WavError(Exception):
    """A WAV file inferctl cannot stream (its one-line reason)."""


def open_wav(path: str, rate: int) -> tuple[wave.Wave_read, BinaryIO | None]:
    """The WAV at ``path`` (``-``: stdin), checked: mono, 16-bit PCM, ``rate`` Hz.
    Returns it and the file to close (None for stdin)."""
    name = "stdin" if path == "-" else path
    try:
        f: BinaryIO = sys.stdin.buffer if path == "-" else open(path, "rb")
    except OSError as e:
        raise WavError(f"cannot read {name}: {e.strerror or e}") from None
    own = None if path == "-" else f
    try:
        w = wave.open(f, "rb")
    except (wave.Error, EOFError) as e:  # "unknown format: 3" for float samples
        if own:
            own.close()
        why = ("not 16-bit integer PCM (float or compressed samples: convert it, e.g. "
               "sox IN -e signed-integer -b 16 OUT.wav)" if "unknown format" in str(e)
               else f"not a WAV file ({e})")
        raise WavError(f"{name}: {why}") from None
    problems = []
    if w.getnchannels() != 1:
        problems.append(f"{w.getnchannels()} channels, not 1 (mono)")
    if w.getsampwidth() != 2:
        problems.append(f"{8 * w.getsampwidth()}-bit samples, not 16-bit")
    if w.getframerate() != rate:
        problems.append(f"{w.getframerate()} Hz, not {rate} Hz (--sr); inferctl does not "
                        f"resample: e.g. sox IN -r {rate} OUT.wav")
    if problems:
        w.close()
        if own:
            own.close()
        raise WavError(f"{name}: {'; '.join(problems)}")
    return w, own


def chunks(w: wave.Wave_read, size: int) -> Iterator[tuple[np.ndarray, int]]:
    """(chunk [1, size] float32, real samples in it) until the end of ``w``; the last
    chunk is zero-padded."""
    while True:
        data = w.readframes(size)
        if not data:
            return
        pcm = np.frombuffer(data, "<i2")
        x = np.zeros((1, size), np.float32)
        x[0, :pcm.size] = pcm.astype(np.float32) / 32768.0
        yield x, int(pcm.size)
        if pcm.size < size:
            return


def _constants(args: argparse.Namespace, c: Client) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for spec in args.const:
        name, sep, value = spec.partition("=")
        if not sep or not name:
            raise SystemExit(f"inferctl: --const expects NAME=VALUE, got {spec!r}")
        if value.endswith(".npy"):
            try:
                out[name] = np.load(value, allow_pickle=False)
            except (OSError, ValueError) as e:
                raise SystemExit(f"inferctl: cannot read {value}: {e}") from None
            continue
        try:
            out[name] = np.array(int(value), np.int64)
        except ValueError:
            try:
                out[name] = np.array(float(value), np.float32)
            except ValueError:
                raise SystemExit(f"inferctl: --const {name}: {value!r} is no number and no "
                                 f".npy file") from None
    if "sr" not in out and "sr" in _input_names(c, args.model):
        out["sr"] = np.array(args.sr, np.int64)
    return out


def _input_names(c: Client, model: str) -> set[str]:
    """The model's input names as the daemon describes it (loading it: the stream's
    first request would)."""
    rows = [m for m in c.models() if m["name"] == model]
    if rows and not rows[0].get("inputs") and rows[0].get("kind") != "graph":
        c.load(model)
        rows = [m for m in c.models() if m["name"] == model]
    return {i["name"] for i in (rows[0].get("inputs") or [])} if rows else set()


def _value(v: np.ndarray) -> Any:
    return v.item() if v.size == 1 else v.tolist()


class StreamInput:
    """The ``-i NAME=FILE.wav`` of ``inferctl stream``, opened and checked before
    inferctl connects (SystemExit with one line)."""

    def __init__(self, args: argparse.Namespace) -> None:
        name, sep, path = args.input.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"inferctl: -i expects NAME=FILE.wav, got {args.input!r}")
        if args.chunk < 1:
            raise SystemExit("inferctl: --chunk must be at least 1")
        try:
            self.wav, self._file = open_wav(path, args.sr)
        except WavError as e:
            raise SystemExit(f"inferctl: {e}") from None
        self.name = name

    def close(self) -> None:
        self.wav.close()
        if self._file:
            self._file.close()


def run_stream(c: Client, args: argparse.Namespace, source: StreamInput) -> int:
    """``inferctl stream``: prints as it goes; returns the exit status."""
    name, w = source.name, source.wav
    rules = SpeechRules(sample_rate=args.sr, window=args.chunk, threshold=args.threshold,
                        min_speech_ms=args.min_speech_ms, min_silence_ms=args.min_silence_ms,
                        speech_pad_ms=args.pad_ms)
    segmenter: SpeechSegmenter | None = SpeechSegmenter(rules)
    samples = n_chunks = n_segments = 0
    padded = 0

    def show(segments: list[Segment]) -> None:
        nonlocal n_segments
        for seg in segments:
            n_segments += 1
            a, b = seg.seconds(args.sr)
            if args.json:
                print(json.dumps({"segment": {"start": seg.start, "end": seg.end,
                                              "start_s": a, "end_s": b}}), flush=True)
            else:
                print(f"speech {a:8.3f} s - {b:8.3f} s  (samples {seg.start} - {seg.end})",
                      flush=True)

    try:
        constants = _constants(args, c)
        with c.stream(args.model, id=args.id, **constants) as s:
            if not args.json and not args.no_chunks:
                print(f"{'CHUNK':>6}  {'TIME_S':>8}  OUTPUTS", flush=True)
            for x, real in chunks(w, args.chunk):
                outputs = s.infer({name: x})
                t = samples / args.sr
                samples += real
                padded = args.chunk - real
                if segmenter is not None:
                    values = list(outputs.values())
                    if len(values) == 1 and values[0].size == 1:
                        found = segmenter.push(float(values[0].reshape(-1)[0]))
                    else:  # not a per-chunk probability: no segments
                        segmenter, found = None, []
                if args.json:
                    if not args.no_chunks:
                        print(json.dumps({"chunk": n_chunks, "start_s": t, "outputs": {
                            k: _value(v) for k, v in outputs.items()}}), flush=True)
                elif not args.no_chunks:
                    shown = ", ".join(
                        f"{k} {v.reshape(-1)[0]:.4f}" if v.size == 1 else
                        f"{k} {v.dtype}{list(v.shape)}" for k, v in outputs.items())
                    print(f"{n_chunks:6d}  {t:8.3f}  {shown}", flush=True)
                n_chunks += 1
                if segmenter is not None:
                    show(found)
    finally:
        source.close()
    if segmenter is not None:
        show(segmenter.finish(samples))
    summary = {"samples": samples, "sample_rate": args.sr, "chunks": n_chunks,
               "chunk": args.chunk, "zero_padded": padded,
               "segments": n_segments if segmenter is not None else None}
    if args.json:
        print(json.dumps({"summary": summary}))
    else:
        last = (f"; the last chunk's {padded} missing samples zero-padded" if padded else "")
        seg = (f"; {n_segments} speech segments (threshold {args.threshold:g}, min speech "
               f"{args.min_speech_ms:g} ms, min silence {args.min_silence_ms:g} ms, pad "
               f"{args.pad_ms:g} ms)" if segmenter is not None else "")
        print(f"{samples} samples at {args.sr} Hz ({samples / args.sr:.2f} s) in {n_chunks} "
              f"chunks of {args.chunk}{last}{seg}")
    return 0
