"""Reconcile a cluster toward its spec: observe -> plan -> act. Used by `up` and `rebalance`.

- One run at a time per cluster (file lock in the cluster dir).
- Idempotent: a launch intent (request id, offer, count) is journaled in the cluster dir
  before the provider is called, and providers dedupe by request id, so a run killed at
  any point and run again launches nothing twice.
- Cool-downs rank, they do not forbid: a zone that preempted or refused a launch is tried
  last; a capacity error backs it off (about a minute, doubling up to `cooldown_s`) and
  the plan is redone without it. `spotctl.control.cooldown` derives both from the event
  journal; the simulator uses the same function on its own events.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

from spotctl.control.cooldown import ZoneCooldowns, zone_cooldowns
from spotctl.control.planner import Observed, ObservedNode, Plan, plan
from spotctl.errors import CapacityError, NotFoundError, SpecError, SpotctlError, StateError
from spotctl.head.client import HeadClient, HeadUnavailable
from spotctl.head.rebalancer import HEAD_DIR_VAR, ON_HEAD_VAR
from spotctl.providers import get_provider
from spotctl.providers.base import HeadInfo, Instance, ProviderContext
from spotctl.spec import ClusterSpec
from spotctl.state import NodeRow, Store, write_json_atomic

Progress = Callable[[str, float | None], None]  # (message, fraction or None)
MAX_FAILOVERS = 20
HEARTBEAT_FRESH_S = 5.0  # a node whose last heartbeat is older is not reporting
# A cloud head's loop paused by this controller resumes by itself after this long, should
# the controller die before it says so
PAUSE_TTL_S = 1800.0
PAUSE_WAIT_S = 900.0  # for the head's run in progress to end


def heartbeat_fresh(h: dict[str, Any] | None) -> bool:
    """A node's entry in the head's status heartbeated within HEARTBEAT_FRESH_S (an age of
    0.0, a heartbeat in the same few milliseconds, is the freshest there is)."""
    age = (h or {}).get("heartbeat_age_s")
    return age is not None and age < HEARTBEAT_FRESH_S


def _noop(msg: str, frac: float | None = None) -> None:
    pass


@dataclass
class ReconcileResult:
    cluster: str
    plan: Plan
    launched: list[Instance] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    bootstrap_failed: list[str] = field(default_factory=list)  # nodes, terminated since
    head: HeadInfo | None = None
    dry_run: bool = False

    def to_json(self) -> dict[str, Any]:
        out = self.plan.to_json()
        out.update(
            cluster=self.cluster, dry_run=self.dry_run, errors=self.errors,
            launched=[i.id for i in self.launched],
        )
        return out


def context(store: Store, spec: ClusterSpec, options: dict[str, Any] | None = None) -> ProviderContext:
    options = dict(options or {})
    if os.environ.get(ON_HEAD_VAR) and "on_head" not in options:
        # the head's own reconcile loop: the provider works from the head VM (its role,
        # the nodes' private addresses, the package the head was given)
        options["on_head"] = os.environ[ON_HEAD_VAR]
        options["head_node_dir"] = os.environ.get(HEAD_DIR_VAR, "")
    return ProviderContext(cluster=spec.name, spec=spec, cluster_dir=store.cluster_dir(spec.name),
                           options=options)


@contextmanager
def head_loop_paused(store: Store, spec: ClusterSpec, options: dict[str, Any] | None,
                     progress: Progress, wait_s: float = PAUSE_WAIT_S,
                     resume: bool = True, must: bool = True) -> Iterator[bool]:
    """While this controller acts on a cloud cluster, the head's own reconcile loop
    ([rebalance] on_head) does not: it is asked to pause (its run in progress ends first)
    and to resume afterwards. Yields whether it is paused; a head that cannot be reached
    runs no loop that could act either. `resume` False: it stays paused (`down`). `must`
    False: a run that does not end within `wait_s` is said, not raised (`down` goes on)."""
    if (not spec.head_rebalances or spec.provider == "local"
            or context(store, spec, options).options.get("on_head")):
        yield False
        return
    try:
        client = head_client(store, spec.name, timeout_s=10)
    except (HeadUnavailable, NotFoundError, StateError):
        yield False
        return
    by = f"{socket.gethostname()} pid {os.getpid()}"
    deadline = time.monotonic() + wait_s
    paused = told = False
    while True:
        try:
            r = client.pause_loop(PAUSE_TTL_S, by)
        except HeadUnavailable as e:
            progress(f"could not pause the head's reconcile loop: {e}", None)
            break
        if r.get("paused") or r.get("loop") is False:
            paused = bool(r.get("paused"))
            break
        if time.monotonic() >= deadline:
            why = (f"cluster {spec.name}: the head's reconcile run did not end within "
                   f"{wait_s:.0f}s ({r.get('busy')})")
            if must:
                raise StateError(f"{why}; try again later")
            progress(f"{why}: going on without pausing it", None)
            break
        if not told:
            progress(f"waiting for the head's reconcile run to end ({r.get('busy')})", None)
            told = True
        time.sleep(1.0)
    try:
        yield paused
    finally:
        if paused and resume:
            try:
                client.resume_loop()
            except HeadUnavailable as e:  # it resumes by itself after PAUSE_TTL_S
                progress(f"could not resume the head's reconcile loop: {e}", None)


def provider_for(store: Store, spec: ClusterSpec, options: dict[str, Any] | None = None) -> Any:
    return get_provider(spec.provider, context(store, spec, options))


def head_client(store: Store, name: str, timeout_s: float = 3.0) -> HeadClient:
    row = store.get_cluster(name)
    url = row.head.get("public_url") or row.head.get("url")
    if row.head.get("tunnel"):
        from spotctl.remote.tunnel import local_url

        try:
            url = local_url(row.head["tunnel"], store.cluster_dir(name).known_hosts)
        except SpotctlError as e:
            raise HeadUnavailable(f"cluster {name}: no SSH tunnel to the head: {e}") from None
    if not url:
        raise HeadUnavailable(f"cluster {name} has no head recorded")
    # a local cluster on a private network: its head is reached from inside it
    from spotctl.providers.local import private

    private.join(store.cluster_dir(name).path)
    return HeadClient(url, store.cluster_dir(name).token(), timeout_s=timeout_s)


def cooldowns(store: Store, spec: ClusterSpec, now: float) -> ZoneCooldowns:
    """Zones cooling down (ranked last) and backing off, from the journal."""
    return zone_cooldowns(store.events(spec.name), spec.rebalance.cooldown_s, now)


def blocked_zones(store: Store, spec: ClusterSpec, now: float) -> dict[str, float]:
    """Zones in their launch back-off after capacity errors (zone -> retry time)."""
    return cooldowns(store, spec, now).blocked


def _plan(store: Store, spec: ClusterSpec, obs: Observed, provider: Any, t: float) -> Plan:
    cd = cooldowns(store, spec, t)
    return plan(spec, obs, cd.offers(provider.offers()), cd.blocked, t, cooling=cd.cooling)


def observe(store: Store, spec: ClusterSpec, provider: Any,
            journal: bool = True) -> tuple[list[Instance], Observed]:
    """List the provider's instances, journal arrivals and departures (unless `journal` is
    False: a dry run writes nothing), build Observed."""
    name = spec.name
    live = [i for i in provider.list(name) if i.role == "worker"]
    if journal:
        journal_nodes(store, spec, provider, live)
    draining = False
    head_ok = True
    try:
        st = head_client(store, name, timeout_s=2).status()
        # the head's answer is input too: anything malformed counts as no answer
        if not isinstance(st, dict) or not isinstance(st.get("nodes", {}), dict):
            raise HeadUnavailable(f"cluster {name}: the head's status is malformed")
        draining = st.get("drain") is not None
        head_nodes = {k: v for k, v in st.get("nodes", {}).items() if isinstance(v, dict)}
    except (HeadUnavailable, NotFoundError):
        head_nodes, head_ok = {}, False
    detector = _load_detector(store, spec)
    now = time.time()
    obs_nodes = []
    for i in live:
        h = head_nodes.get(i.id, {})
        hs = h.get("state", "")
        state = "draining" if hs in ("leaving", "left") else i.state
        if hs == "failed":
            # its agent refused to train (GPU gate: no driver, too few GPUs): replace it
            state = "lost"
        # No false recoveries: one silent reply never makes a node lost; N silent
        # observations spanning T seconds do (or the provider saying it is gone).
        age = h.get("heartbeat_age_s")
        age = age if isinstance(age, (int, float)) and not isinstance(age, bool) else 0
        fresh = hs not in ("", "unresponsive") and age < 10
        booting = now - (i.launched_at or now) < 300 and not hs
        if head_ok and not booting:
            if detector.observe(i.id, seen=fresh, provider_gone=False, now=now).value == "lost":
                state = "lost"
        obs_nodes.append(ObservedNode(
            id=i.id, zone=i.zone, region=_region(i, spec), instance_type=i.instance_type,
            gpus=i.gpus, price=i.price, state=state,
            gpu_name=str(i.meta.get("gpu_name") or ""),
            group=h["group"] if isinstance(h.get("group"), str) else "",
        ))
    detector.prune({i.id for i in live})
    if journal:
        write_json_atomic(store.cluster_dir(name).path / "liveness.json", detector.to_dict())
    return live, Observed(nodes=tuple(obs_nodes), drain_in_progress=draining)


def journal_nodes(store: Store, spec: ClusterSpec, provider: Any,
                  live: list[Instance]) -> None:
    """The provider's live workers into the journal: arrivals (a node the head's own loop
    launched, too) and departures (preempted or gone)."""
    name = spec.name
    ids = {i.id for i in live}
    known = {n.id: n for n in store.nodes(name)}
    for inst in live:
        row = known.get(inst.id)
        if row is None or row.state != inst.state or row.ended_at is not None:
            store.upsert_node(_row(inst, name, spec.provider))
    for nid, row in known.items():
        if row.ended_at is None and nid not in ids:
            end = _end_state(provider, nid)
            store.set_node_state(name, nid, end, ended=True)
            store.add_event(name, "preempted" if end == "preempted" else "node-gone",
                            {"node": nid, "zone": row.zone, "state": end})


def _load_detector(store: Store, spec: ClusterSpec) -> Any:
    from spotctl.control.liveness import LossDetector

    p = store.cluster_dir(spec.name).path / "liveness.json"
    try:
        data = json.loads(p.read_text()) if p.exists() else None
    except ValueError:
        data = None
    return LossDetector.from_dict(data, spec.rebalance.lost_after_observations,
                                  spec.rebalance.lost_after_s)


def _region(i: Instance, spec: ClusterSpec) -> str:
    return i.meta.get("region") or {"aws": spec.aws.region, "gcp": spec.gcp.region}.get(
        spec.provider, spec.provider)


def _end_state(provider: Any, nid: str) -> str:
    for inst in getattr(provider, "all_instances", lambda: [])():
        if inst.id == nid:
            return "preempted" if inst.meta.get("end_state") == "preempted" else "lost"
    return "lost"


def _row(inst: Instance, cluster: str, provider: str) -> NodeRow:
    return NodeRow(
        id=inst.id, cluster=cluster, provider=provider, zone=inst.zone,
        instance_type=inst.instance_type, gpus=inst.gpus, state=inst.state, price=inst.price,
        on_demand_price=inst.on_demand_price, launched_at=inst.launched_at or time.time(),
        ended_at=None, request_id=inst.request_id,
        address=inst.public_address or inst.address,
        meta={k: v for k, v in inst.meta.items() if isinstance(v, str | int | float | None)}
        | {"ssh_port": inst.ssh_port, "ssh_user": inst.ssh_user},
    )


def check_engine(spec: ClusterSpec) -> None:
    """The torchft engine needs torchft on this controller: the head's Lighthouse runs from
    it (local, ssh) and the nodes install it from here (aws, gcp, ssh). Checked before
    anything is created, so a controller without it launches nothing."""
    if spec.train.engine != "torchft":
        return
    try:
        found = importlib.util.find_spec("torchft") is not None
    except (ImportError, ValueError):  # a broken or blocked install
        found = False
    if not found:
        raise SpecError(
            'train.engine = "torchft" needs torchft on this controller and it is '
            "not installed: pip install 'spotctl[train]', or set [train] engine = \"torchrun\""
        )


def check_shared_hosts(spec: ClusterSpec) -> None:
    """An ssh cluster's listeners sit on loopback, unauthenticated (the head's store and
    Lighthouse on this controller's and, forwarded, on each host's; each host's training
    listeners on its own), and every user of a machine reaches its loopback: refused
    before anything is joined or started, until the spec says no one else uses them."""
    if spec.provider != "ssh" or spec.ssh.dedicated_hosts:
        return
    raise SpecError(
        "ssh hosts: the cluster's store and Lighthouse listen unauthenticated on the "
        "loopback of this controller and of every host, where any other user of those "
        "machines can reach them (a store pickle runs as the training user); set [ssh] "
        "dedicated_hosts = true once no one else uses them, or use provider local (a "
        "network namespace of its own), aws or gcp (see docs/security.md)"
    )


def reconcile(
    store: Store,
    spec: ClusterSpec,
    *,
    dry_run: bool = False,
    options: dict[str, Any] | None = None,
    progress: Progress = _noop,
    create: bool = True,
    now: Callable[[], float] = time.time,
) -> ReconcileResult:
    """Bring the cluster toward spec. `create` False (rebalance) refuses unknown clusters."""
    name = spec.name
    cdir = store.cluster_dir(name)
    provider = provider_for(store, spec, options)
    if dry_run:
        obs = Observed()
        try:
            store.get_cluster(name)
            _, obs = observe(store, spec, provider, journal=False)
        except NotFoundError:
            pass
        p = _plan(store, spec, obs, provider, now())
        return ReconcileResult(cluster=name, plan=p, dry_run=True)
    if not create:
        store.get_cluster(name)
    check_engine(spec)
    check_shared_hosts(spec)
    with cdir.lock(on_wait=progress), ExitStack() as paused:
        # Re-checked under the lock: a rebalance that waited for `down` must not bring
        # the cluster back (down holds this lock while it cleans up).
        try:
            before = store.get_cluster(name).state
        except NotFoundError:
            before = "down"
        if not create and before == "down":
            raise StateError(f"cluster {name} is down; `spotctl up` starts it again")
        store.upsert_cluster(name, spec.provider, spec.model_dump(mode="json"), "starting")
        progress("preparing cluster resources", None)
        if hasattr(provider, "prepare"):
            provider.prepare()
        # a cluster already up keeps its head (ensure_head starts one only if it is gone)
        progress("starting the head" if before == "down" else "checking the head", None)
        head = provider.ensure_head() if hasattr(provider, "ensure_head") else None
        if head is not None:
            store.set_head(name, head.__dict__)
            paused.enter_context(head_loop_paused(store, spec, options, progress))
        result = ReconcileResult(cluster=name, plan=Plan(), head=head)
        _resume_intent(store, spec, provider, result)
        for _ in range(MAX_FAILOVERS):
            live, obs = observe(store, spec, provider)
            p = _plan(store, spec, obs, provider, now())
            result.plan.notes = p.notes
            todo = [a for a in p.actions if a.type != "launch" or a.count > 0]
            if not todo:
                break
            failed = False
            for act in todo:
                result.plan.actions.append(act)
                store.add_event(name, "plan-" + act.type, act.to_json())
                if act.type == "terminate":
                    _stop_nodes(store, spec, provider, list(act.node_ids), act.drain, act.reason)
                    continue
                launches = list(act.launches) if act.type == "move" else [act]
                for la in launches:
                    if not _launch(store, spec, provider, la, head, result, progress):
                        failed = True
                        break
                if failed:
                    break
                if act.type in ("replace", "move") and act.node_ids:
                    # the old nodes drain through the head now; a later run terminates them
                    # once they have left the job
                    _stop_nodes(store, spec, provider, list(act.node_ids), True, act.reason)
            if not failed:
                break
        store.set_cluster_state(name, "running")
        return result


def _launch(store: Store, spec: ClusterSpec, provider: Any, act: Any, head: HeadInfo | None,
            result: ReconcileResult, progress: Progress) -> bool:
    """Launch one offer; on a capacity error block its zone and say so (False)."""
    cdir = store.cluster_dir(spec.name)
    req = f"{spec.name}-{uuid.uuid4().hex[:10]}"
    intent = {"request_id": req, "offer": act.offer.__dict__, "count": act.count,
              "reason": act.reason}
    write_json_atomic(cdir.path / "launch-intent.json", intent)
    progress(f"launching {act.count} x {act.offer.instance_type} in {act.offer.zone}", None)
    try:
        insts = provider.launch(act.offer, act.count, req)
    except CapacityError as e:
        (cdir.path / "launch-intent.json").unlink(missing_ok=True)
        store.add_event(spec.name, "capacity-error", {
            "zone": act.offer.zone, "instance_type": act.offer.instance_type, "count": act.count,
            "error": str(e), **({"placement": act.offer.placement} if act.offer.placement
                                else {})})
        result.errors.append(str(e))
        return False
    _journal_launch(store, spec, insts, act.reason, req, act.offer.placement)
    (cdir.path / "launch-intent.json").unlink(missing_ok=True)
    result.launched.extend(insts)
    if hasattr(provider, "bootstrap") and insts:
        progress(f"bootstrapping {len(insts)} node(s)", None)
        _bootstrap(store, spec, provider, insts, head, result, progress)
    return True


def _stop_nodes(store: Store, spec: ClusterSpec, provider: Any, ids: list[str], drain: bool,
                reason: str) -> None:
    """Stop nodes: a node in the job drains first (through the head, one at a time); a node
    already out of the job (lost, left) is terminated now."""
    if not ids:
        return
    state: dict[str, Any] = {}
    try:
        client = head_client(store, spec.name, timeout_s=3)
        state = client.status().get("nodes", {})
    except (HeadUnavailable, NotFoundError):
        client = None
    gone = [i for i in ids if not drain or state.get(i, {}).get("state") in
            (None, "left", "unresponsive", "waiting", "finished")]
    if gone:
        provider.terminate(gone)
        for nid in gone:
            store.set_node_state(spec.name, nid, "terminated", ended=True)
            store.add_event(spec.name, "terminate", {"node": nid, "reason": reason})
        if client is not None:
            try:
                client.forget(gone)
            except HeadUnavailable:
                pass
    rest = [i for i in ids if i not in gone]
    if rest and client is not None:
        try:
            gen = client.drain("rebalance", rest)
            store.add_event(spec.name, "drain-requested", {"nodes": rest, "gen": gen,
                                                           "reason": reason})
        except HeadUnavailable as e:
            store.add_event(spec.name, "drain-failed", {"nodes": rest, "error": str(e)})


def _journal_launch(store: Store, spec: ClusterSpec, insts: list[Instance], reason: str,
                    req: str, placement: str = "") -> None:
    for inst in insts:
        store.upsert_node(_row(inst, spec.name, spec.provider))
        store.add_event(spec.name, "launch", {
            "node": inst.id, "zone": inst.zone, "instance_type": inst.instance_type,
            "gpus": inst.gpus, "price": inst.price, "request_id": req, "reason": reason,
            **({"placement": placement} if placement else {}),
        })


def _resume_intent(store: Store, spec: ClusterSpec, provider: Any, result: ReconcileResult) -> None:
    """A previous run died between journaling an intent and recording its result: replay
    the same request id (the provider dedupes) so nothing is launched twice or leaked."""
    p = store.cluster_dir(spec.name).path / "launch-intent.json"
    if not p.exists():
        return
    from spotctl.providers.base import Offer

    try:
        intent = json.loads(p.read_text())
        raw = dict(intent["offer"])
        offer = Offer(**{**raw, "placements": tuple(raw.get("placements") or ())})
        if not isinstance(intent["request_id"], str) or int(intent["count"]) < 1:
            raise ValueError("bad request_id or count")
    except (OSError, ValueError, KeyError, TypeError) as e:
        # unreadable: set it aside (kept for a post-mortem) instead of blocking every
        # later run; whatever it launched is tagged and found by the next observe()
        bad = p.with_name(f"launch-intent.corrupt-{int(time.time())}.json")
        p.replace(bad)
        result.errors.append(f"set aside a corrupt launch intent ({e}): {bad.name}")
        store.add_event(spec.name, "launch-intent-corrupt", {"file": bad.name, "error": str(e)})
        return
    try:
        insts = provider.launch(offer, int(intent["count"]), intent["request_id"])
    except SpotctlError as e:
        result.errors.append(f"replaying interrupted launch: {e}")
        insts = []
    _journal_launch(store, spec, insts, intent.get("reason", "resume"), intent["request_id"],
                    offer.placement)
    p.unlink(missing_ok=True)
    result.launched.extend(insts)


def _bootstrap(store: Store, spec: ClusterSpec, provider: Any, insts: list[Instance],
               head: HeadInfo | None, result: ReconcileResult,
               progress: Progress = _noop) -> None:
    def host_done(r: Any, done: int, total: int) -> None:  # remote.bootstrap.HostProgress
        state = "ok" if r.ok else f"failed: {r.reason}"
        if getattr(r, "note", ""):
            state += f"; {r.note}"
        sent = getattr(r, "sent_bytes", 0)  # what was uploaded (package, project, config)
        size = f", sent {sent / 2**20:.1f} MiB" if sent >= 2**20 else f", sent {sent} B" if sent else ""
        progress(f"bootstrapped {r.node_id} in {r.seconds:.1f}s{size} ({done}/{total}, {state})",
                 done / total if total else 1.0)

    try:
        if "progress" in inspect.signature(provider.bootstrap).parameters:
            results = provider.bootstrap(insts, progress=host_done)
        else:
            results = provider.bootstrap(insts)
    except SpotctlError as e:
        result.errors.append(str(e))
        return
    failed = []
    for r in results or []:
        if not getattr(r, "ok", True):
            result.errors.append(f"{r.node_id}: {r.reason}")
            store.add_event(spec.name, "bootstrap-failed", {"node": r.node_id, "reason": r.reason})
            failed.append(r.node_id)
    result.bootstrap_failed += failed
    if failed:
        # a node whose bootstrap failed never runs an agent (nothing to drain) and would
        # bill until `down`: it goes now, and the next plan replaces it
        try:
            provider.terminate(failed)
        except SpotctlError as e:
            result.errors.append(f"terminating node(s) whose bootstrap failed: {e}")
            return
        for nid in failed:
            store.set_node_state(spec.name, nid, "terminated", ended=True)
            store.add_event(spec.name, "terminate", {"node": nid, "reason": "bootstrap failed"})


def wait_for_nodes(store: Store, name: str, timeout_s: float,
                   progress: Progress = _noop) -> tuple[int, int]:
    """Wait until every live node (not leaving) heartbeats to the head: (seen, expected)."""
    deadline = time.monotonic() + timeout_s
    seen = count = 0
    while time.monotonic() < deadline:
        expected = {n.id for n in store.nodes(name, include_ended=False)}
        try:
            st = head_client(store, name).status()
            hn = st["nodes"]
            expected -= {k for k, v in hn.items()
                         if v["state"] in ("leaving", "left", "failed")}
            seen = sum(1 for k in expected if k in hn and hn[k]["state"] in ("running", "waiting")
                       and heartbeat_fresh(hn[k]))
        except HeadUnavailable:
            seen = 0
        count = len(expected)
        progress(f"{seen}/{count} nodes reporting", seen / count if count else 1.0)
        if seen >= count:
            return seen, count
        time.sleep(0.3)
    return seen, count


def sync_events(store: Store, name: str) -> int:
    """Import the head's events into the journal (deduped by the head's sequence number).

    Best effort: the head's answer is checked event by event (seq an integer, ts a finite
    number, type a short printable name, data JSON); a malformed event is skipped, never
    raised. Returns how many were skipped."""
    try:
        client = head_client(store, name, timeout_s=3)
        evs = client.events(0)
    except (HeadUnavailable, NotFoundError):
        return 0
    if not isinstance(evs, list):
        return 1
    skipped = 0
    for e in evs:
        ok = _head_event(e)
        if ok is None:
            skipped += 1
            continue
        seq, ts, typ, data = ok
        try:
            store.add_event(name, typ, data, ts=ts, source_key=f"head:{name}:{seq}:{int(ts)}")
        except (ValueError, TypeError, OverflowError):
            skipped += 1
    return skipped


def _head_event(e: Any) -> tuple[int, float, str, dict[str, Any]] | None:
    import math

    if not isinstance(e, dict):
        return None
    seq, ts, typ = e.get("seq"), e.get("ts"), e.get("type")
    if isinstance(seq, bool) or not isinstance(seq, int) or not 0 < seq < 1 << 53:
        return None
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) \
            or not 0 <= ts < 1e11:
        return None
    if not isinstance(typ, str) or not 0 < len(typ) <= 64 or not typ.isprintable():
        return None
    data = {k: v for k, v in e.items() if k not in ("seq", "ts", "type")}
    try:
        json.dumps(data, allow_nan=False)
    except (ValueError, TypeError, RecursionError):
        return None
    # fields that status, cost, report and the planner compute with have their type
    for k, v in data.items():
        if k in _NUMERIC_EVENT_FIELDS and v is not None and (
                isinstance(v, bool) or not isinstance(v, (int, float))):
            return None
        if k in ("node", "zone", "reason") and not isinstance(v, str):
            return None
    return seq, float(ts), typ, data


_NUMERIC_EVENT_FIELDS = frozenset({
    "lost_steps", "resume_step", "checkpoint_step", "from_world_size", "to_world_size",
    "world_size", "notice_to_resume_s", "worker_spawned_after_s", "gen", "step",
    "previous_seq", "silent_s", "count", "price", "replica_pause_s", "pause_s",
})


@dataclass
class DownResult:
    """What `down` did: leak descriptions, and what became of the checkpoints."""

    cluster: str
    leaks: list[str]
    purge: bool  # checkpoints were asked to be deleted
    purged: int | None  # objects deleted under the cluster's prefix (None: not purged)
    can_purge: bool = False  # the provider owns a checkpoint store (`down --purge` works)
    kept_at: str | None = None  # where the checkpoints are, where the provider says

    def to_json(self) -> dict[str, Any]:
        return {"cluster": self.cluster, "leaks": self.leaks,
                "checkpoints": "deleted" if self.purge else "kept", "purged": self.purged}


def down(store: Store, name: str, options: dict[str, Any] | None = None,
         progress: Progress = _noop) -> list[str]:
    """Stop everything the cluster runs or owns; returns leak descriptions."""
    return teardown(store, name, options=options, progress=progress).leaks


def teardown(store: Store, name: str, purge: bool = False,
             options: dict[str, Any] | None = None, progress: Progress = _noop) -> DownResult:
    """`down`: stop everything the cluster runs or owns. Its checkpoints stay, unless
    `purge`: then, after the cleanup, the provider's `purge_checkpoints()` deletes the
    objects under the cluster's checkpoint prefix and says how many. A provider without a
    checkpoint store of its own (no `purge_checkpoints`) refuses a purge before anything
    is stopped."""
    row = store.get_cluster(name)
    spec = ClusterSpec.model_validate(row.spec)
    provider = provider_for(store, spec, options)
    can_purge = hasattr(provider, "purge_checkpoints") and getattr(provider, "can_purge", True)
    if purge and not can_purge:
        raise SpecError(f"--purge: the {spec.provider} provider keeps no checkpoint store of "
                        f"its own to delete (train.checkpoint_dir is yours to remove)")
    # the cron line goes first: no scheduled rebalance starts while (or after) we clean up
    try:
        from spotctl.control import cron

        cron.remove(name)
    except Exception:  # no crontab on this machine, or no line: nothing to remove
        pass
    with store.cluster_dir(name).lock(on_wait=progress):
        try:
            sync_events(store, name)
        except Exception as e:  # the head's events are a nicety; cleanup is not
            progress(f"could not import the head's events: {e}", None)
        with head_loop_paused(store, spec, options, progress, wait_s=120.0, resume=False,
                              must=False):
            pass  # no replacement starts while the cluster goes; the head goes with it
        progress("stopping nodes and head", None)
        leaks = provider.cleanup() if hasattr(provider, "cleanup") else []
        if not hasattr(provider, "cleanup"):
            provider.terminate([i.id for i in provider.list(name)])
        for n in store.nodes(name, include_ended=False):
            store.set_node_state(name, n.id, "terminated", ended=True)
        purged: int | None = None
        if purge:
            progress("deleting the checkpoints", None)
            try:
                purged = int(provider.purge_checkpoints())
            except SpotctlError as e:  # the rest is down: say what is left, exit non-zero
                leaks = [*leaks, f"checkpoints not deleted: {e}"]
        store.set_cluster_state(name, "down")
        store.add_event(name, "down", {"leaks": leaks, **({"purged": purged} if purge else {})})
        kept_at = provider.checkpoints_at() if hasattr(provider, "checkpoints_at") else None
        return DownResult(name, leaks, purge, purged, can_purge, kept_at)
