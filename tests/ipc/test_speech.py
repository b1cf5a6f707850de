"""Speech segments from per-chunk probabilities (ipc/speech.py) by silero-vad's rules: the
expected segments are what silero-vad 6.2.3's own ``get_speech_timestamps_from_probs``
gives for the same probabilities and length (its defaults; computed with the wheel, which
needs torch: tests/e2e/test_vad_stream.py compares with it directly on real audio and on
random sequences); and each segment is given as soon as it is final."""

from __future__ import annotations

import pytest

from inferd.ipc.speech import Segment, SpeechRules, SpeechSegmenter, speech_segments

S, Q = 0.9, 0.1
CASES = {
    # silence, speech, silence long enough, speech, silence
    "two": ([Q] * 5 + [S] * 12 + [Q] * 6 + [S] * 10 + [Q] * 8,
            [(2080, 9184), (11296, 17376)]),
    "short_dropped": ([Q] * 3 + [S] * 7 + [Q] * 10, []),  # 7 x 512 = 224 ms <= 250
    # 0.4 is not speech to begin, nor silence to end (exit threshold 0.35)
    "hysteresis": ([Q] * 2 + [S] * 10 + [0.4] * 10 + [S] * 2 + [Q] * 10, [(544, 12768)]),
    "open_at_end": ([Q] * 4 + [S] * 20, [(1568, 12188)]),  # ends at the audio's length
    "brief_dip": ([Q] * 2 + [S] * 10 + [Q] * 3 + [S] * 10 + [Q] * 8, [(544, 13280)]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_segments_equal_silero_vads(name: str) -> None:
    probs, want = CASES[name]
    audio = len(probs) * 512 - 100  # the last chunk was zero-padded
    assert [(s.start, s.end) for s in speech_segments(probs, audio)] == want


def test_each_segment_is_given_when_final() -> None:
    """With silero's defaults the silence that ends a segment (100 ms) is longer than its
    two pads (60 ms): a segment is given at the chunk that ends it, not at the end."""
    probs, want = CASES["two"]
    seg = SpeechSegmenter()
    given = {}
    for i, p in enumerate(probs):
        for s in seg.push(p):
            given[i] = (s.start, s.end)
    # the first ends at chunk 17, 4 chunks (128 ms >= 100) of silence later: chunk 21
    assert given == {21: want[0], 37: want[1]}
    assert seg.finish(len(probs) * 512 - 100) == []
    with pytest.raises(ValueError):
        seg.push(0.5)


def test_closer_segments_share_their_gap() -> None:
    """Pads of 300 ms and no minimum silence: two segments 2 chunks apart share the
    gap half and half; a short segment between them that is dropped fixes nothing."""
    rules = SpeechRules(speech_pad_ms=300, min_silence_ms=0)
    probs = [S] * 10 + [Q] * 2 + [S] * 10 + [Q] * 3 + [S] * 2 + [Q] * 30
    got = speech_segments(probs, len(probs) * 512, rules)
    assert got == [Segment(0, 5632), Segment(5632, 16064)]  # silero: the same
    assert Segment(16000, 32000).seconds(16000) == (1.0, 2.0)
