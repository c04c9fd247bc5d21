"""gcp-storage-emulator with two fixes: a multipart upload's content is read byte for byte, and connections queue.

gcsfs writes its multipart uploads with bare LF line endings; the emulator parses them with the email package, which
takes a carriage return at the end of the content for part of the line ending before the closing boundary: an
object whose last byte is 0x0d is stored one byte short (1 random upload in 256; measured: of the 256 possible last
bytes only 13 loses it). Real GCS keeps every byte. Here the multipart/related body is split on its boundary with
the line ending the body itself uses (the one after its first delimiter: CRLF as RFC 2046 writes it, or gcsfs's LF),
and everything else is the emulator's own code. Run as the emulator's command line:
``python tests/gcs_emulator.py start --host 127.0.0.1 --port N --in-memory``.
"""

from __future__ import annotations

import json
import sys
from email.message import Message

from gcp_storage_emulator import server
from gcp_storage_emulator.__main__ import main

_read_data = server._read_data


def _parameter(content_type: str, name: str) -> str:
    message = Message()
    message["Content-Type"] = content_type
    return str(message.get_param(name) or "")


def _split_related(raw: bytes, boundary: str) -> list[tuple[Message, bytes]]:
    """The parts of a multipart body: each part's headers and its exact content."""
    opening = b"--" + boundary.encode()
    start = raw.index(opening) + len(opening)
    eol = b"\r\n" if raw[start:start + 2] == b"\r\n" else b"\n"
    pieces = (eol + raw[raw.index(opening):]).split(eol + opening)[1:]   # [0]: the preamble
    parts = []
    for piece in pieces:
        if piece.startswith(b"--"):                        # the close delimiter
            break
        head, _, content = piece.partition(eol + eol)
        headers = Message()
        for line in head.split(eol)[1:]:                   # [0] is the rest of the delimiter line
            key, _, value = line.decode("latin-1").partition(":")
            headers[key.strip()] = value.strip()
        parts.append((headers, content))
    return parts


def _read_data_exactly(request_handler, query):
    content_type = request_handler.headers.get("Content-Type") or ""
    if not content_type.startswith("multipart/related"):
        return _read_data(request_handler, query)
    raw = server._decode_raw_data(server._read_raw_data(request_handler), request_handler)
    if not raw:
        return None
    (_, meta), (headers, content) = _split_related(raw, _parameter(content_type, "boundary"))[:2]
    return {"meta": json.loads(meta), "content": content,
            "content-type": headers.get_content_type()}


server._read_data = _read_data_exactly
# A second difference: the emulator serves one connection at a time with socketserver's listen backlog of 5, so a
# client opening more connections at once (the table reader's footer and decode threads: 8 and more) has some
# SYNs dropped and retried after 1 s, 3 s, ... (measured: 16 ranged reads in 8 threads took 16 s, 0.3 s in one).
# Real GCS accepts them all; a deeper backlog makes the emulator queue them instead.
server.server.HTTPServer.request_queue_size = 256  # (http.server, as the emulator imports it)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
