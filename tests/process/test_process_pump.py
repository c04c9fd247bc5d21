"""`stratkit.process.pump`: every line handed on once, in order, with one tail policy and the last exception."""

from __future__ import annotations

import os
import threading

from stratkit.process.pump import MAX_LINE_BYTES, TAIL_LINE_CHARS, TAIL_LINES, Line, OutputPump, Tail, prefixed


def _pipes(**data: bytes) -> dict:
    """Pipes already holding `data` (written by threads: a pipe holds only 64 KiB), ends closed after."""
    streams = {}
    for name, payload in data.items():
        read, write = os.pipe()

        def writer(fd: int = write, payload: bytes = payload) -> None:
            with os.fdopen(fd, "wb") as handle:
                handle.write(payload)

        threading.Thread(target=writer, daemon=True).start()
        streams[name] = os.fdopen(read, "rb", buffering=0)
    return streams


def _pump(**data: bytes) -> tuple[OutputPump, list[Line]]:
    seen: list[Line] = []
    pump = OutputPump(_pipes(**data), seen.append)
    pump.run()
    return pump, seen


def test_lines_are_handed_on_whole_with_their_stream_and_a_last_line_without_newline():
    pump, seen = _pump(stdout=b"one\ntwo\r\nthree", stderr="caf\u00e9 \xff\n".encode("latin-1"))
    by_stream = {s: [(line.text, line.raw) for line in seen if line.stream == s] for s in ("stdout", "stderr")}
    assert by_stream["stdout"] == [("one", b"one"), ("two", b"two\r"), ("three", b"three")]
    assert by_stream["stderr"][0][0] == "caf\ufffd \ufffd"  # invalid UTF-8 replaced, never an exception
    assert sorted(pump.tail.lines()) == sorted(line.text for line in seen)


def test_a_line_longer_than_the_bound_is_handed_on_in_pieces_and_cut_in_the_tail():
    long = b"x" * (3 * MAX_LINE_BYTES)
    pump, seen = _pump(stdout=long + b"\nend\n")
    assert b"".join(line.raw for line in seen[:-1]) == long  # nothing lost on the way to the console
    assert all(len(line.raw) <= 2 * MAX_LINE_BYTES for line in seen)
    assert seen[-1].text == "end"
    assert all(len(text) <= TAIL_LINE_CHARS + len(" ...(truncated)") for text in pump.tail.lines())
    assert pump.tail.lines()[0].endswith(" ...(truncated)")


def test_the_tail_keeps_the_last_lines_and_the_scanner_the_exception_printed_before_them():
    frames = "".join(f"  frame {i}\n" for i in range(200))
    output = "Traceback (most recent call last):\n" + frames + "ValueError: bad input\nafter 1\n"
    output += "".join(f"noise {i}\n" for i in range(TAIL_LINES))
    pump, _ = _pump(stderr=output.encode())
    assert len(pump.tail) == TAIL_LINES == 50
    assert pump.tail.lines()[-1] == f"noise {TAIL_LINES - 1}" and "ValueError: bad input" not in pump.tail.lines()
    assert pump.scanner.exception[0] == "ValueError: bad input"


def test_a_tail_cuts_long_lines_and_forgets_old_ones():
    tail = Tail(lines=2, chars=5)
    for text in ("a", "bb", "cccccccc"):
        tail.add(text)
    assert tail.lines() == ("bb", "ccccc ...(truncated)")


def test_a_started_pump_runs_in_its_own_thread_until_the_pipes_close():
    seen: list[Line] = []
    pump = OutputPump(_pipes(stdout=b"a\nb\n"), seen.append, name="test-pump").start()
    pump.join(5)
    assert [line.text for line in seen] == ["a", "b"]
    assert prefixed("worker:1", "a") == "[worker:1] a"


def test_lines_a_keep_filter_rejects_reach_neither_the_tail_nor_the_consumer():
    seen: list[Line] = []
    pump = OutputPump(_pipes(output=b"noise: cuda not found\nstep 1\nnoise: again\n"), seen.append,
                      keep=lambda text: not text.startswith("noise"))
    pump.run()
    assert [line.text for line in seen] == ["step 1"] and pump.tail.lines() == ("step 1",)
