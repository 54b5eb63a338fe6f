"""AWS provider: spot GPU instances through boto3 (the only module that imports it).

This module owns the assembled AwsProvider (offers.py, network.py, launch.py and check.py
on top of api.py), the head (start, wait, `spotctl head` over SSH), worker bootstrap and cleanup.

Everything the cluster owns is tagged at creation with `spotctl:cluster` (instances also
with `spotctl:role` and `spotctl:request-id`), and tags are the source of truth: `list`,
idempotent `launch` and `cleanup` all find resources by tag.

Endpoint and credentials come from the usual boto3 chain; `AWS_ENDPOINT_URL` (honoured by
boto3 itself) points it at moto in tests, and `ctx.options["endpoint_url"]` overrides it.

Test/ops knobs in `ctx.options` (never set by users): endpoint_url, ssh_cidr,
retry_attempts (default 5), retry_base_s (0.5), poll_s (5), wait_timeout_s (300),
head_process (default True: `ensure_head` also starts `spotctl head` on the head VM over
SSH; provider unit tests turn it off, their fake instances have no SSH).

Bootstrap (head and workers) goes over SSH to each instance's public address as
`aws.ssh_user` with the cluster's key pair (spotctl.remote.bootstrap.CloudNodes). Test seam:
`SPOTCTL_SSH_OVERRIDE=127.0.0.1:PORT` (+ `SPOTCTL_SSH_OVERRIDE_KEY`, `SPOTCTL_HEAD_PORTS`,
`SPOTCTL_SSH_REMOTE_ROOT`) sends every instance's SSH to one loopback sshd and puts the
head on that address, so `up -> status -> down` runs on moto with real SSH, head and agents
(tests/aws/test_up_flow.py). Under the seam, `cleanup` also stops the processes the
"instances" ran, as terminating a real VM would.
"""

from __future__ import annotations

import builtins
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from spotctl.errors import ProviderError, TransientError
from spotctl.providers.aws.api import HEAD_TOKEN_FILE, TAG_REQUEST, error_code
from spotctl.providers.aws.check import AwsChecks
from spotctl.providers.base import HeadInfo, Instance, ProviderContext, Teardown, start_new_head
from spotctl.providers.hostkeys import parse_console_keys, pin_published, wait_settings
from spotctl.remote.bootstrap import HostProgress, HostResult


class AwsProvider(AwsChecks):
    """Spot workers and an on-demand head in one region, tagged by cluster.

    Launch path: `run_instances` with `InstanceMarketOptions` spot, one offer (type and
    zone) per call, MinCount=MaxCount=count (all or nothing). Chosen over an instant EC2
    Fleet because the planner already picks the offer (type, zone) and
    `launch_with_failover` walks the alternatives, so the fleet's own allocation strategy
    would have one choice; run_instances raises the capacity error codes synchronously
    (a fleet reports them as per-override entries in a 200 response), needs no launch
    template to create, tag and clean up, and its ClientToken gives EC2-side idempotency.
    """

    name = "aws"

    def prepare(self) -> None:
        """Security group and key pair (network.py), then checkpoint bucket and the
        workers' instance profile (storage.py), and the head's when it replaces nodes;
        idempotent, run by every `up`. On the head itself nothing is made or changed:
        its role may not, and the controller made all of it."""
        if self._on_head:
            if self._prepared is None:
                groups = self._find_groups()
                if not groups:
                    raise ProviderError(f"aws: cluster {self.ctx.cluster} has no security "
                                        "group (was it taken down?)")
                if not self.key_path.exists():
                    raise ProviderError(f"aws: the cluster's SSH key is missing on the head "
                                        f"({self.key_path})")
                self._prepared = (str(groups[0]["GroupId"]), self.key_name)
            return
        super().prepare()
        self.prepare_storage()
        if self.ctx.spec.head_rebalances:
            self._ensure_head_identity()

    # ---- head -----------------------------------------------------------------------

    def _wait_running(self, instance_id: str) -> dict[str, Any]:
        deadline = time.monotonic() + self._wait_timeout_s
        while True:
            raw = self._describe(
                [{"Name": "instance-id", "Values": [instance_id]}],
                f"wait for head {instance_id}",
            )
            state = raw[0]["State"]["Name"] if raw else "unknown"
            if raw and state == "running" and raw[0].get("PrivateIpAddress"):
                return raw[0]
            if state in ("shutting-down", "terminated", "stopping", "stopped"):
                raise ProviderError(f"aws: head {instance_id} went {state} while starting")
            if time.monotonic() >= deadline:
                raise TransientError(
                    f"aws: head {instance_id} not running after {self._wait_timeout_s:.0f}s "
                    f"(state {state})"
                )
            time.sleep(self._poll_s)

    def _head_token(self, renew: bool) -> str:
        """The head's launch token, kept in the cluster dir so a retry reuses it."""
        path = self.ctx.path / HEAD_TOKEN_FILE
        if renew or not path.exists():
            self.ctx.cluster_dir.ensure()
            path.write_text(f"{self.ctx.cluster[:20]}-head-{uuid.uuid4().hex[:16]}\n")
        return path.read_text().strip()

    def ensure_head(self) -> HeadInfo:
        """An on-demand head (aws.head_instance_type) tagged role=head, started if absent,
        running `spotctl head` (started over SSH if not running; token uploaded 0600).

        Nodes reach the head at its private address. The controller uses `public_url`
        (the head's public address): the coordinator and store ports are open to the
        cluster's group only, so outside the VPC that needs an SSH tunnel to the head
        (not built yet); under the test seam it is the loopback address.
        """
        if self._on_head:
            # the head's own loop: this VM is the head; nothing to start or reach by SSH
            inst = self._to_instance(self._wait_running(self._on_head))
            self._head = self._nodes.head(inst, False, "aws")
            return self._head
        heads = [i for i in self.list(self.ctx.cluster) if i.role == "head"]
        live = [h for h in heads if h.state in ("pending", "running")]
        if live:
            head_id = live[0].id
        else:
            token = self._head_token(renew=bool(heads) or self._head_gone())
            started = self._run(
                f"start head {self.spec.head_instance_type} (on-demand) in {self.region}",
                instance_type=self.spec.head_instance_type,
                zone="",
                count=1,
                request_id=token,
                token=token,
                role="head",
                tags={},
                spot=False,
            )
            head_id = started[0].id
        inst = self._to_instance(self._wait_running(head_id))
        self._pin_host_keys(inst, fresh=not live)
        self._head = start_new_head(
            lambda: self._nodes.head(inst, self._head_process, "aws"), head_id,
            self.terminate, created=not live,
        )
        return self._head

    def bootstrap(
        self, instances: Sequence[Instance], progress: HostProgress | None = None
    ) -> builtins.list[HostResult]:
        """Make launched workers nodes over SSH: wait until each runs (addresses known),
        start its agent (AWS IMDSv2 notices), confirm its first heartbeat at the head.
        Per-host results; one host failing never hides the others."""
        head = self._head or self.ensure_head()
        ready: builtins.list[Instance] = []
        failed: builtins.list[HostResult] = []
        for inst in instances:
            try:
                # several EFA interfaces: its public address is an Elastic IP, given now
                raw = self._ensure_public_address(self._wait_running(inst.id))
                ready.append(self._to_instance(raw))
            except ProviderError as e:
                failed.append(HostResult(inst.id, False, str(e), False, 0.0))
        for inst in ready:
            self._pin_host_keys(inst)
        return self._nodes.bootstrap(ready, head, progress=progress, failed=failed)

    def console_host_keys(self, instance_id: str) -> builtins.list[tuple[str, str]]:
        """The instance's SSH host keys as cloud-init printed them on its console, [] while
        the console output is not there yet (it lags boot by a minute or more)."""
        out: dict[str, Any] = {}
        # the latest output is Nitro's; other types answer UnsupportedOperation to it and
        # give the buffered output (updated at state changes) instead
        for latest in (True, False):
            try:
                out = self._call(
                    f"read console output of {instance_id}",
                    self.ec2.get_console_output,
                    InstanceId=instance_id,
                    **({"Latest": True} if latest else {}),
                )
                break
            except ProviderError as e:
                if error_code(e) == "InvalidInstanceID.NotFound":
                    return []
                if error_code(e) != "UnsupportedOperation":
                    raise
                if not latest:
                    return []
        return parse_console_keys(str(out.get("Output") or ""))

    def _pin_host_keys(self, inst: Instance, fresh: bool = True) -> None:
        """Pin the keys EC2 reports for this instance before the first SSH (not under
        the loopback test seam, where one sshd stands in for every instance)."""
        # the head's own loop reaches nodes at their private address (CloudNodes.target)
        address = inst.address if self._on_head else inst.public_address
        if self._nodes.override is not None or not address:
            return
        wait_s, poll_s = wait_settings(self.ctx.options)
        pin_published(self.ctx.cluster_dir.known_hosts, address,
                      lambda: self.console_host_keys(inst.id),
                      fresh=fresh, wait_s=wait_s, poll_s=poll_s)

    def _head_gone(self) -> bool:
        """True when the saved head token already launched a head that is now gone."""
        path = self.ctx.path / HEAD_TOKEN_FILE
        if not path.exists():
            return False
        raw = self._describe(
            self._cluster_filter()
            + [{"Name": f"tag:{TAG_REQUEST}", "Values": [path.read_text().strip()]}],
            "look up the previous head",
        )
        return bool(raw)

    # ---- cleanup --------------------------------------------------------------------

    def _wait_gone(self, ids: Iterable[str]) -> builtins.list[str]:
        ids = list(ids)
        deadline = time.monotonic() + self._wait_timeout_s
        while ids:
            ids = self._live_ids(ids, "wait for instances to terminate")
            if not ids or time.monotonic() >= deadline:
                break
            time.sleep(self._poll_s)
        return ids

    def cleanup(self) -> builtins.list[str]:
        """Terminate every instance of the cluster, then its security group and key pair.

        Returns one line per thing that is still there afterwards (empty when clean).
        """
        td = Teardown()
        insts = td.step("list the cluster's instances", lambda: self.list(self.ctx.cluster), [])
        if self._nodes.override is not None:
            # Test seam: the "instances" are processes behind one sshd; stop them as
            # terminating the VMs would.
            td.leaks += [f"{r.node_id}: {r.reason}"
                         for r in self._nodes.release(insts) if not r.ok]
        ids = [i.id for i in insts]
        def terminate() -> bool:
            self.terminate(ids)
            return True

        asked = td.step("terminate instances", terminate, False)
        # (instances never asked to end are not waited for: they are reported as they are)
        left = td.step("wait for the instances to end", lambda: self._wait_gone(ids), ids) \
            if asked else ids
        # a launch that was in flight while the list was made (the head's own loop, cut
        # short by its own end) shows up now: it goes too
        late = td.step("look for instances launched meanwhile",
                       lambda: [i for i in self.list(self.ctx.cluster) if i.id not in ids],
                       [])  # fmt: skip
        if late:
            late_ids = [i.id for i in late]
            if self._nodes.override is not None:  # (the seam, as above)
                td.leaks += [f"{r.node_id}: {r.reason}"
                             for r in self._nodes.release(late) if not r.ok]
            td.step("terminate instances launched meanwhile",
                    lambda: self.terminate(late_ids))
            left = [*left, *td.step("wait for them to end",
                                    lambda: self._wait_gone(late_ids), late_ids)]  # fmt: skip
        for i in left:
            td.leaks.append(f"instance {i} in {self.region} still not terminated")
        for group in td.step("find security groups", self._find_groups, []):
            td.step(f"security group {group['GroupId']} ({group.get('GroupName', '')})",
                    lambda g=group: self._delete_group(str(g["GroupId"])))
        # placement groups, after their instances (one still in use stays, as a line)
        for pg in td.step("find placement groups", self._find_placement_groups, []):
            td.step(f"placement group {pg['GroupName']}",
                    lambda n=str(pg["GroupName"]): self._delete_placement_group(n))
        pairs = td.step(
            f"find key pairs of cluster {self.ctx.cluster}",
            lambda: self._call(f"find key pairs of cluster {self.ctx.cluster}",
                               self.ec2.describe_key_pairs, Filters=self._cluster_filter()),
            {},
        ).get("KeyPairs", [])
        for pair in pairs:
            td.step(f"key pair {pair['KeyName']}",
                    lambda k=pair["KeyName"]: self._call(f"delete key pair {k}",
                                                         self.ec2.delete_key_pair, KeyName=k))
        # Elastic IPs of nodes with several EFA interfaces, once their instances are gone
        td.leaks += td.step("the cluster's Elastic IPs", self._release_addresses, [])
        # The workers' role and profile go; the checkpoints stay unless purged.
        td.leaks += td.step("the workers' role", self._delete_node_identity, [])
        if self.ctx.options.get("purge"):
            td.step("purge checkpoints", self.purge_checkpoints)
        leaks = td.leaks
        self._prepared = None
        if not leaks:
            self.key_path.unlink(missing_ok=True)
            (self.ctx.path / HEAD_TOKEN_FILE).unlink(missing_ok=True)
        return leaks


    def _delete_group(self, gid: str) -> None:
        """Delete a security group; network interfaces of just-terminated instances linger
        a little (DependencyViolation until the timeout); a group already gone is fine."""
        deadline = time.monotonic() + self._wait_timeout_s
        while True:
            try:
                self._call(f"delete security group {gid}", self.ec2.delete_security_group,
                           GroupId=gid)
                return
            except ProviderError as e:
                if error_code(e) == "InvalidGroup.NotFound":
                    return
                if error_code(e) == "DependencyViolation" and time.monotonic() < deadline:
                    time.sleep(self._poll_s)
                    continue
                raise


def create(ctx: ProviderContext) -> AwsProvider:
    return AwsProvider(ctx)
