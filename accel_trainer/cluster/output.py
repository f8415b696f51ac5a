"""What `accel-trainer launch` shows of the launcher's output, and the lines it ends a failed run with.

When a worker fails, torch elastic's agent ends with a ChildFailedError traceback: the launcher's own frames, then
a table per failed rank (time, host, rank, exit code, pid), some 40 lines after the ranks' own `error:` line. The
wrapper passes the output through as it comes, progress bars included, but holds a traceback back until its last
line says what it is: torch elastic's report is left out (its exit codes go into the wrapper's last line), any
other traceback (a recipe's bug, the rendezvous failing) is shown whole.
"""

from __future__ import annotations

import re
import signal

TRACEBACK = b"Traceback (most recent call last):"
CHILD_FAILED = b"torch.distributed.elastic.multiprocessing.errors.ChildFailedError"
_FAILURE = re.compile(r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)")


class Passthrough:
    """Feed it the launcher's output as it comes (`feed`), write what it returns; `end()` at the end of the output.
    What it left out is in `report`, the failed ranks' exit codes in `exit_codes()`."""

    def __init__(self):
        self.pending = b""  # the start of a line not yet complete
        self.held: list[bytes] = []  # a traceback, until its last line
        self.dropping = False  # inside torch elastic's report: until its closing rule of '='
        self.rules = 0
        self.report: list[str] = []

    def feed(self, chunk: bytes) -> bytes:
        *lines, self.pending = (self.pending + chunk).split(b"\n")
        shown = b"".join(self._line(line + b"\n") for line in lines)
        # A line still being written (a progress bar redrawn with \r) is shown at once, unless it may begin a
        # traceback or falls inside one.
        if self.pending and not (self.held or self.dropping or TRACEBACK.startswith(self.pending)):
            shown, self.pending = shown + self.pending, b""
        return shown

    def end(self) -> bytes:
        """What is still held when the output ends: a traceback cut short is shown as it is."""
        held, self.held = b"".join(self.held), []
        rest, self.pending = (b"" if self.dropping else self.pending), b""
        return held + rest

    def _line(self, line: bytes) -> bytes:
        text = line.rstrip(b"\r\n")
        if self.dropping:
            self.report.append(text.decode(errors="replace"))
            if len(text) >= 20 and not text.strip(b"="):
                self.rules += 1
                self.dropping = self.rules < 2  # the table opens and closes with one
            return b""
        if self.held:
            if text[:1] in (b" ", b"\t"):  # a frame, its source line, its ^^^ marks
                self.held.append(line)
                return b""
            held, self.held = b"".join(self.held), []
            if text.startswith(CHILD_FAILED):  # the traceback's last line says whose it is
                self.dropping, self.rules = True, 0
                self.report += [held.decode(errors="replace"), text.decode(errors="replace")]
                return b""
            return held + self._line(line)
        if text == TRACEBACK:
            self.held = [line]
            return b""
        return line

    def exit_codes(self) -> dict[int, int]:
        """{rank: exit code} of the ranks torch elastic's left-out report named; a signal is a negative code."""
        return {int(r): int(c) for r, c in sorted(_FAILURE.findall("\n".join(self.report)), key=lambda m: int(m[0]))}


def describe_exit_codes(codes: dict[int, int]) -> str:
    """`rank 0: exit code 1, rank 1: killed by SIGKILL`."""

    def one(code: int) -> str:
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                pass
        return f"exit code {code}"

    return ", ".join(f"rank {rank}: {one(code)}" for rank, code in codes.items())


def error_lines(output: str) -> list[str]:
    """The ranks' `error:` lines (the Trainer's one line each), each once, in the order they came."""
    return list(dict.fromkeys(line.strip() for line in output.splitlines() if line.startswith("error: ")))
