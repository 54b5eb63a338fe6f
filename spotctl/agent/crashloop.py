"""A job that keeps failing the same way is an error, not a wait.

The agent reads what its workers wrote to torchrun's log since it last looked, takes the
last line of the last Python traceback in it (the exception: `ValueError: ...`), and counts
failures in a row that end on the same line with no step made in between. At `limit` of
them it stops restarting (spotctl.agent.supervisor: agent state "crashed") and reports the
line to the head, which `status` shows and `up` exits with.

The log is written by the training user's processes: what is read from it is data, bounded
(at most READ_MAX bytes a look) and cleaned to one printable line of at most LINE_MAX
characters before it goes anywhere."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

CRASH_LIMIT = 3  # identical failures in a row (SPOTCTL_CRASH_LIMIT; 0 turns it off)
READ_MAX = 256 * 1024  # bytes of new log read per look (its tail, when more came)
LINE_MAX = 400  # characters of the error line kept (a checkpoint path may be long)
# the tracebacks torchrun itself prints after a worker failed: its own, not the cause
LAUNCHER_ERRORS = ("torch.distributed.elastic.", "ChildFailedError")
# a line spotctl.elastic ends a worker with (a SystemExit: no traceback), e.g. the
# checkpoint another job wrote (ResumeMismatch)
FATAL_PREFIX = "spotctl.elastic: "


def crash_limit(env: dict[str, str] | None = None) -> int:
    """CRASH_LIMIT, or SPOTCTL_CRASH_LIMIT when it is a whole number >= 0 (0: never stop)."""
    raw = (os.environ if env is None else env).get("SPOTCTL_CRASH_LIMIT", "")
    return int(raw) if raw.isdigit() else CRASH_LIMIT


def clean_line(text: str) -> str:
    """One printable line of at most LINE_MAX characters (control characters dropped)."""
    line = "".join(c if c.isprintable() else " " for c in text).strip()
    return line if len(line) <= LINE_MAX else line[: LINE_MAX - 3] + "..."


def last_error(text: str) -> tuple[str | None, int]:
    """The last line of the last traceback in `text` whose exception is not the launcher's
    own, or the last line spotctl.elastic ended a worker with (FATAL_PREFIX), cleaned
    (None when there is none), and where in `text` a traceback still being
    written starts (len(text) when none is: read it again once it is whole)."""
    parts = text.split("\n")  # "\n" only: a "\r" in a message does not end its line
    lines = [x + "\n" for x in parts[:-1]] + ([parts[-1]] if parts[-1] else [])
    found: str | None = None
    pending = len(text)
    pos = i = 0
    while i < len(lines):
        if not lines[i].lstrip().startswith("Traceback (most recent call last):"):
            if lines[i].startswith(FATAL_PREFIX) and lines[i].endswith("\n"):
                found = lines[i].strip()
            pos += len(lines[i])
            i += 1
            continue
        start = pos
        indent = len(lines[i]) - len(lines[i].lstrip())
        pos += len(lines[i])
        i += 1
        # the frames are indented deeper than the header; the exception line is not
        while i < len(lines) and (not lines[i].strip()
                                  or len(lines[i]) - len(lines[i].lstrip()) > indent):
            pos += len(lines[i])
            i += 1
        if i >= len(lines) or not lines[i].endswith("\n"):
            pending = start  # its exception line is not written yet
            break
        line = lines[i].strip()
        if not line.startswith(LAUNCHER_ERRORS):
            found = line
        pos += len(lines[i])
        i += 1
    return (None if found is None else clean_line(found)), pending


@dataclass
class CrashWatch:
    """Counts failures in a row with the same error line, from the new bytes of `log`."""

    log: Path
    limit: int = CRASH_LIMIT
    offset: int = 0
    line: str | None = None  # the error line of the failures counted
    count: int = 0
    step: int = -1  # the highest step the workers had reported at the last failure
    seen: list[str] = field(default_factory=list)

    def skip_to_end(self) -> None:
        """What is already in the log is not news (an agent restarted over an old log)."""
        try:
            self.offset = self.log.stat().st_size
        except OSError:
            self.offset = 0

    def _new_text(self) -> str:
        try:
            with open(self.log, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < self.offset:  # truncated or replaced: read it anew
                    self.offset = 0
                if size == self.offset:
                    return ""
                start = max(self.offset, size - READ_MAX)
                f.seek(start)
                data = f.read(size - start)
                self.offset = size
        except OSError:
            return ""
        # surrogateescape: the bytes of a traceback still being written map back exactly
        return data.decode("utf-8", "surrogateescape")

    def look(self, step: int | None, count: bool = True) -> bool:
        """Read what the workers wrote since the last look; True when the same failure has
        now happened `limit` times in a row with no step made in between (the agent stops).
        `step`: the highest step the node's workers report now (None: none reported);
        `count`: False reads past what came without counting it."""
        now = -1 if step is None else step
        if now > self.step and self.count:
            self.count, self.line = 0, None  # it made progress since: not a loop
        text = self._new_text()
        err, pending = last_error(text)
        if pending < len(text):  # read that traceback again when it is whole
            self.offset -= len(text[pending:].encode("utf-8", "surrogateescape"))
        if err is None or not count:
            return False
        if err == self.line:
            self.count += 1
        else:
            self.line, self.count = err, 1
        self.step = max(self.step, now)
        return self.limit > 0 and self.count >= self.limit
