"""A JSON array read one element at a time: ``[ {...}, {...} ]`` files never decoded whole.

LLaMA-Factory's ``data/*.json``, Alpaca's original file and many Hub dumps are one JSON array
of records. ``array_items`` splits such a stream into the raw bytes of each element by
following only its strings and brackets (the elements themselves are decoded later, one at a
time, by ``sources.parse_record``), so memory is one read chunk plus one element, and an
element longer than the limit is skipped without being held. A broken frame (the file ends
inside the array, a bracket closes the wrong one, an empty element, data after the closing
``]``) cannot be resynchronised and raises ``InputError`` naming the file, the record and the
line; an element that is framed but malformed is left to the parser, which rejects that one
record like a bad JSON line.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import BinaryIO

from nedolm.data.sources import InputError

_CHUNK = 1 << 18
# A whole string without escapes (skipped at C speed), or one byte that frames elements: a
# bracket, a comma, or a quote opening a string left to ``_string_end`` (escapes, or an end the
# buffer does not hold yet). A regex for escaped strings too would keep backtracking state per
# escape: megabytes for one long string.
_TOKEN = re.compile(rb'"[^"\\]*"|["\[\]{},]')
_OPENS = {ord("["): ord("]"), ord("{"): ord("}")}
_QUOTE, _BACKSLASH, _COMMA, _CLOSE_BRACE = ord('"'), ord("\\"), ord(","), ord("}")
_BOM = b"\xef\xbb\xbf"
_WHITESPACE = b" \t\r\n"


def starts_array(f: BinaryIO) -> bool:
    """Whether the stream's first byte past a BOM and whitespace is ``[`` (not consumed).

    ``f`` must support ``peek`` (buffered files, ``GzipFile``); a JSON-lines file never starts
    with ``[``, since each of its lines must be an object.
    """
    head = f.peek(64).removeprefix(_BOM).lstrip(_WHITESPACE)
    return head[:1] == b"["


class Oversized(bytes):
    """Stands for an element longer than the limit, which was skipped, never held whole."""

    size: int


def array_items(f: BinaryIO, name: str, max_bytes: int) -> Iterator[tuple[int, bytes]]:
    """(0-based index, raw bytes) of every element of the JSON array ``f`` holds.

    An element over ``max_bytes`` comes as an ``Oversized`` holding its size. Raises
    ``InputError`` on a broken frame (see the module docstring); ``name`` names the file.
    """
    return _Scanner(f, name, max_bytes).items()


class _Scanner:
    """The state of one pass over the array: a buffer of the unconsumed bytes and the bracket
    stack of the element being scanned."""

    def __init__(self, f: BinaryIO, name: str, max_bytes: int) -> None:
        self.f, self.name, self.max_bytes = f, name, max_bytes
        self.buf = bytearray()
        self.base_lines = 0  # newlines in the bytes already dropped from the buffer's front
        self.index = 0  # the element being scanned

    def items(self) -> Iterator[tuple[int, bytes]]:
        start = self._open()
        pos, stack, in_string, skipped = start, bytearray(), False, 0
        while True:
            if in_string:
                end = _string_end(self.buf, pos)
                if end is None:
                    pos = _resume_point(self.buf, pos)
                else:
                    in_string, pos = False, end
                    continue
            else:
                match = _TOKEN.search(self.buf, pos)
                if match is None:
                    pos = len(self.buf)
                else:
                    at, pos = match.start(), match.end()
                    byte = self.buf[at]
                    if byte == _QUOTE:
                        in_string = pos - at == 1  # the rest of the string is still to come
                    elif byte in _OPENS:
                        stack.append(byte)
                    elif stack:  # a closer or a comma inside the element
                        if byte != _COMMA:
                            self._close(stack, byte, at)
                    elif byte == _CLOSE_BRACE:
                        self._fail(at, "a '}' closes the array's '['; the array cannot be read on")
                    else:  # a comma or the array's own ']' ends the element
                        item = self._element(start, at, skipped, last=byte != _COMMA)
                        if item is not None:
                            yield self.index, item
                            self.index += 1
                        if byte != _COMMA:
                            self._expect_end(pos)
                            return
                        start, skipped = pos, 0
                    continue
            # The buffer is scanned up to ``pos``: drop what is no longer needed, read more.
            if len(self.buf) - start > self.max_bytes:  # too long: keep only its frame
                skipped += pos - start
                start = pos
            self._drop(start)
            start, pos = 0, pos - start
            if not self._fill():
                self._fail(
                    len(self.buf), "the file ends before the JSON array is closed (cut off?)"
                )

    def _open(self) -> int:
        """Position just past the opening ``[`` (``starts_array`` said it is there)."""
        self._fill()
        while not self.buf.removeprefix(_BOM).lstrip(_WHITESPACE) and self._fill():
            pass
        return self.buf.index(b"[") + 1

    def _element(self, start: int, end: int, skipped: int, last: bool) -> bytes | None:
        raw = bytes(self.buf[start:end].strip(_WHITESPACE))
        size = skipped + end - start if skipped else len(raw)
        if not raw and not skipped:
            if last and self.index == 0:
                return None  # ``[]``: no records
            self._fail(end, "an empty record (two commas, or a comma before ']')")
        if size > self.max_bytes:
            item = Oversized(b"<oversized record>")
            item.size = size
            return item
        return raw

    def _close(self, stack: bytearray, byte: int, at: int) -> None:
        opener = stack.pop()
        if _OPENS[opener] != byte:
            self._fail(at, f"a {chr(byte)!r} closes a {chr(opener)!r}; the array cannot be read on")

    def _expect_end(self, pos: int) -> None:
        while True:
            rest = self.buf[pos:].lstrip(_WHITESPACE)
            if rest:
                at = len(self.buf) - len(rest)
                self._fail(at, "data after the closing ']' of the JSON array")
            self._drop(len(self.buf))
            pos = 0
            if not self._fill():
                return

    def _fill(self) -> bool:
        chunk = self.f.read(_CHUNK)
        self.buf += chunk
        return bool(chunk)

    def _drop(self, count: int) -> None:
        self.base_lines += self.buf.count(b"\n", 0, count)
        del self.buf[:count]

    def _fail(self, at: int, what: str) -> None:
        line = self.base_lines + self.buf.count(b"\n", 0, at) + 1
        raise InputError(f"{self.name}: record {self.index} (line {line}): {what}")


def _string_end(buf: bytearray, pos: int) -> int | None:
    """Position just past the quote closing the string being scanned from ``pos``, or None when
    the buffer ends first."""
    while (quote := buf.find(b'"', pos)) >= 0:
        first = quote
        while first > 0 and buf[first - 1] == _BACKSLASH:
            first -= 1
        if (quote - first) % 2 == 0:  # an even run of backslashes escapes only themselves
            return quote + 1
        pos = quote + 1
    return None


def _resume_point(buf: bytearray, pos: int) -> int:
    """Where to look for the string's end once more bytes came: the buffer's end, or the start
    of a run of backslashes it ends with (the next byte may be the one they escape)."""
    end = len(buf)
    while end > pos and buf[end - 1] == _BACKSLASH:
        end -= 1
    return end
