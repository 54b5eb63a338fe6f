"""Issue 57, the head's side: a plain torchrun script (route "plain", reported by its
workers' launch hook) moves a torchft cluster onto the restart cycle once, with one event
saying why; the nodes start together once every agent restarted its torchrun; a plain
group's drain tells the agents its deadline; its rescales name the route and claim no
lost steps (the script's own checkpoint decides what it redoes)."""

from __future__ import annotations

from spotctl.head import validate
from spotctl.head.coordinator import Coordinator
from tests.unit.test_coordinator import Clock, hb, w


def plain(rank, inc, step=0, phase="train", ws=3, first=999.0, **kw):
    return w(rank, inc, step, phase=phase, ws=ws, first=first, route="plain", **kw)


def test_plain_workers_on_torchft_switch_the_cluster_to_torchrun_once() -> None:
    clk = Clock()
    c = Coordinator(clk, engine="torchft")
    for n in ("a", "b", "c"):
        assert hb(c, n, "waiting")["engine"] == "torchft"
        hb(c, n, "running")
    # each node's own torchrun formed a group of one: the hook reports and trains nothing
    r = hb(c, "a", workers=[plain(0, "x", phase="init", ws=1, first=None)])
    assert r["engine"] == "torchrun" and c.engine == "torchrun"
    hb(c, "b", workers=[plain(0, "y", phase="init", ws=1, first=None)])
    assert [e["type"] for e in c.events].count("route") == 1
    ev = next(e for e in c.events if e["type"] == "route")
    assert ev["route"] == "plain" and "not one torchft replica per node" in ev["why"]
    # a restarts first: no go while b and c still run their old torchrun (it would train
    # alone at world 1 and restart twice as the others come)
    clk.t += 1
    assert not hb(c, "a", "waiting")["go"]
    hb(c, "b", "waiting")
    assert not hb(c, "a", "waiting")["go"]
    hb(c, "c", "waiting")
    r = hb(c, "a", "waiting")
    # the first round waits for all three (spotctl.elastic.rdzv), not torch's 1 s last call
    assert r["go"] and r["start_nodes"] == 3 and hb(c, "c", "waiting")["go"]
    for i, n in enumerate(("a", "b", "c")):
        hb(c, n, workers=[plain(i, "inc1", 0)])
    assert "start_nodes" not in hb(c, "a", workers=[plain(0, "inc1", 1)])
    st = c.status()
    assert (st["route"], st["engine"]) == ("plain", "torchrun")


def test_plain_drain_carries_its_deadline_and_rescale_claims_no_lost_steps() -> None:
    clk = Clock()
    c = Coordinator(clk)
    for n in ("a", "b", "c"):
        assert hb(c, n, "waiting")["go"]
    for i, n in enumerate(("a", "b", "c")):
        hb(c, n, workers=[plain(i, "inc1", 40)])
    assert c.status()["world_size"] == 3
    r = hb(c, "b", workers=[plain(1, "inc1", 41)],
           notice={"id": "n", "deadline": clk.t + 120})
    d = r["drain"]
    # the agents end the grace themselves: the head's own timeout stays behind the notice
    assert d["leave"] and d["deadline"] == clk.t + 120 - 2.0
    for i, n in enumerate(("a", "b", "c")):
        hb(c, n, workers=[plain(i, "inc1", 45, phase="drained", drain_step=45)], drain_gen=1)
    hb(c, "b", "left")
    clk.t += 1
    hb(c, "a", workers=[plain(0, "inc2", 0, ws=2, first=clk.t)])
    rs = [e for e in c.events if e["type"] == "rescale"]
    assert len(rs) == 1 and rs[0]["route"] == "plain" and rs[0]["lost_steps"] is None
    assert (rs[0]["from_world_size"], rs[0]["to_world_size"]) == (3, 2)
    assert c.status()["restarts"] == 1


def test_the_head_accepts_only_known_routes() -> None:
    ok = validate.worker(plain(0, "i"), 0)
    assert ok["route"] == "plain"
    try:
        validate.worker(dict(plain(0, "i"), route="mine"), 0)
    except validate.BadInput as e:
        assert "route must be plain or elastic" in str(e)
    else:
        raise AssertionError("an unknown route was accepted")


def test_rendezvous_event_names_come_from_the_frame_not_inspect_stack() -> None:
    """torch names rendezvous events after _record's caller; spotctl's handler takes the
    name from the frame (inspect.stack() cost seconds in a zygote-forked torchrun under load,
    and a node late to a round never got onto the wait list). Same names as torch's."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    from spotctl.elastic import rdzv

    def _record() -> str:
        return str(dr.get_method_name())

    def _add_to_wait_list() -> str:
        return _record()

    before = _add_to_wait_list()
    rdzv._cheap_event_names()
    assert getattr(dr.get_method_name, "_spotctl", False)
    assert _add_to_wait_list() == before == "_add_to_wait_list"
