"""The cap on a checkpoint file's parts in flight (spotctl.elastic.parts), exactly: a
stream never has more than `in_flight` parts uploading, and it does use that many. That is
the memory bound the module promises (at most in_flight + 1 parts held). A part here is a
future that completes only when the stream waits for one (the stream's own wait, stood in
for by one that completes the oldest part it is given), so the count is the stream's
doing, not the timing of a server. Real uploads (moto, the GCS stand-in):
tests/integration/test_checkpoint.py."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest

from spotctl.elastic import parts


class _Stream(parts._Parts):
    """A stream whose parts finish only when the stream waits for them."""

    def __init__(self, in_flight: int) -> None:
        super().__init__(fs=None, path="b/f", part=8, in_flight=in_flight)
        self.seen: list[int] = []  # parts uploading as each new part starts (it included)
        self.completed: list[bytes] = []
        self.chunks: list[bytes] = []

    def _part(self, number: int, chunk: bytes) -> Future[Any]:
        self.seen.append(sum(1 for f in self.parts if not f.done()) + 1)
        self.chunks.append(chunk)
        return Future()

    def _complete(self, results: list[Any]) -> None:
        self.completed = results


@pytest.fixture(autouse=True)
def _wait_finishes_the_oldest(monkeypatch: pytest.MonkeyPatch) -> None:
    def wait(fs: list[Future[Any]], return_when: Any = None) -> None:
        assert fs, "waited on no part"
        fs[0].set_result({"ETag": "x"})

    monkeypatch.setattr(parts, "wait", wait)


@pytest.mark.parametrize("in_flight", [parts.PARTS_IN_FLIGHT, 1, 2])
def test_parts_in_flight_reach_the_cap_and_never_pass_it(in_flight: int) -> None:
    """kills: the in-flight part cap off by one (`len(running) > self.in_flight`) or
    removed (the wait loop dropped)."""
    s = _Stream(in_flight)
    data = bytes(range(10)) * 8  # 80 bytes: 10 parts of 8
    for i in range(0, len(data), 3):  # writes that do not line up with the parts
        s.write(data[i:i + 3])
    assert len(s.seen) == 10
    assert max(s.seen) == in_flight, s.seen  # never more, and it uses them all
    assert s.seen[:in_flight] == list(range(1, in_flight + 1)), s.seen
    assert b"".join(s.chunks) == data  # in order, whole


def test_the_default_cap_is_four_parts() -> None:
    """The figure the module's docstring and the docs promise (a memory bound of 5 parts
    of SPOTCTL_CHECKPOINT_PART_MB)."""
    assert parts.PARTS_IN_FLIGHT == 4
    assert "PARTS_IN_FLIGHT + 1 parts in memory" in (parts.__doc__ or "")
