"""The torchft engine's quorum ids stay unique when the Lighthouse restarts (it numbers its
quorums from 1 again): torchft reconfigures its process group only on a new id, under a
store prefix that must never be reused. The Lighthouse's answers come from a stand-in
client (the edge); the real restart is fault scenario 6 on torchft."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from spotctl.elastic.ft import UniqueQuorums


@dataclass
class Answer:
    quorum_id: int
    replica_ids: list[str]
    max_step: int
    store_address: str = "127.0.0.1:1"
    heal: bool = False


@dataclass
class Client:
    answers: list[Answer] = field(default_factory=list)
    committed: list[int] = field(default_factory=list)

    def _quorum(self, **kw: Any) -> Answer:
        return self.answers.pop(0)

    def should_commit(self, group_rank: int, step: int, should_commit: bool, timeout: Any) -> bool:
        self.committed.append(step)
        return should_commit


ABC = ["a:1", "b:2", "c:3"]


def _ids(answers: list[Answer]) -> list[int]:
    tap = UniqueQuorums(Client(list(answers)))
    return [tap._quorum(step=0).quorum_id for _ in answers]


def test_one_id_while_the_lighthouse_quorum_and_its_members_hold() -> None:
    ids = _ids([Answer(3, ABC, 10), Answer(3, ABC, 11), Answer(3, ABC, 12)])
    assert len(set(ids)) == 1 and ids[0] >= 0


def test_a_restarted_lighthouse_reusing_an_id_gets_a_new_one() -> None:
    # life 1: quorums 1 (a), 2 (a, b), 3 (a, b, c); the Lighthouse restarts at step 40 and
    # numbers from 1 again, with members it had under other numbers
    life1 = [Answer(1, ABC[:1], 0), Answer(2, ABC[:2], 5), Answer(3, ABC, 9)]
    life2 = [Answer(1, ABC[:2], 40), Answer(2, ABC, 41), Answer(3, ABC, 42)]
    ids = _ids(life1 + life2)
    assert len(set(ids)) == 6, ids
    # even the same number with the same members is a new quorum after a restart
    again = _ids([Answer(2, ABC, 5), Answer(1, ABC, 60), Answer(2, ABC, 61)])
    assert len(set(again)) == 3, again


def test_every_member_derives_the_same_id() -> None:
    seq = [Answer(4, ABC, 20), Answer(4, ABC, 21), Answer(1, ABC[1:], 22)]
    assert _ids(seq) == _ids(seq)


def test_the_rest_of_the_answer_and_client_read_through() -> None:
    client = Client([Answer(7, ABC, 3, store_address="10.0.0.9:5", heal=True)])
    tap = UniqueQuorums(client)
    q = tap._quorum(step=3)
    assert q.quorum_id != 7 and tap.lighthouse_quorum_id == 7
    assert q.store_address == "10.0.0.9:5" and q.heal and q.max_step == 3
    assert tap.should_commit(0, 3, True, None) and client.committed == [3]
