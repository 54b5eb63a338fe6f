"""GCP provider: Spot VMs through google-cloud-compute (REST), labels as the source of truth.

This module owns the assembled GcpProvider (offers.py, network.py, storage.py, launch.py
and check.py on top of api.py), the head VM, worker bootstrap and cleanup.

What it assumes and guarantees (on top of providers/base.py):
- Every VM carries the labels spotctl-cluster / spotctl-role / spotctl-request-id from its
  insert request, so `list` finds it even if the controller dies right after the insert.
  No VM carries a network tag: the firewall rules pick the cluster's VMs by the service
  account they run as (network.py), which the head may not choose freely (storage.py).
- Worker names are derived from (cluster, request id, index): a retried launch finds the
  instances of the first try by label, and a re-sent insert is refused as alreadyExists
  instead of creating a twin (inserts also carry a deterministic requestId UUID).
- Zone exhaustion (ZONE_RESOURCE_POOL_EXHAUSTED[_WITH_DETAILS], arriving as an operation
  error or as an HTTP error body) moves the rest of the request to the next zone of the
  region that sells the same shape, without backoff. Quota and auth errors stop at once.
  429 / 5xx are retried with bounded exponential backoff, then raise TransientError.
- Operations are waited on with our own Zone/GlobalOperationsClient built with the same
  endpoint as the InstancesClient. We never call `.result()` on the SDK's extended
  operation: its poller builds a fresh client on the default endpoint and would ignore
  `client_options` (a test pointed at a fake would poll the real API).

The SDK is imported inside functions so `spotctl prices --provider gcp` and every other
provider work without google-cloud-compute installed.

Test seams (ctx.options, never set by users): gcp_endpoint (or env SPOTCTL_GCP_ENDPOINT),
gcp_backoff_base, gcp_backoff_max, gcp_attempts, gcp_poll_interval, gcp_op_timeout,
ssh_public_key, ssh_cidr, head_api_port, head_store_port, gcp_disk_gb, region,
head_process (default True: `ensure_head` also starts `spotctl head` on the head VM over
SSH; provider unit tests turn it off, their fake VMs have no SSH).

Bootstrap (head and workers) goes over SSH to each VM's external address as
`gcp.ssh_user` with the cluster's own key (spotctl.remote.bootstrap.CloudNodes). Test seam:
`SPOTCTL_SSH_OVERRIDE=127.0.0.1:PORT` (+ `SPOTCTL_SSH_OVERRIDE_KEY`, `SPOTCTL_HEAD_PORTS`,
`SPOTCTL_SSH_REMOTE_ROOT`) sends every VM's SSH to one loopback sshd and puts the head on
that address, so `up -> status -> down` runs on the fake Compute API with real SSH, head
and agents (tests/gcp/test_up_flow.py). Under the seam, `cleanup` also stops the
processes the "VMs" ran, as deleting a real VM would.
"""

from __future__ import annotations

import builtins
import time
from collections.abc import Sequence
from functools import partial

from spotctl.errors import ProviderError, SpecError
from spotctl.providers.base import HeadInfo, Instance, ProviderContext, Teardown, start_new_head
from spotctl.providers.gcp import catalog as catalog_gcp
from spotctl.providers.gcp.api import (
    _STATES,
    HEAD_REQUEST_ID,
    LABEL_CLUSTER,
    LABEL_ROLE,
    _short,
    firewall_names,
    head_name,
    label_value,
)
from spotctl.providers.gcp.check import GcpChecks
from spotctl.providers.hostkeys import pin_published, wait_settings
from spotctl.remote.bootstrap import HostProgress, HostResult


class GcpProvider(GcpChecks):
    """Spot workers and one standard head VM in one GCP project and region."""

    name = "gcp"
    purged: int | None = None  # objects `cleanup` deleted under the prefix (purge option)

    def prepare(self) -> None:
        """The checkpoint bucket, the workers' and the head's service accounts (the
        head's rights where it replaces nodes; storage.py), then the firewall rules, which
        name those accounts, and the SSH key (network.py); idempotent, run by every `up`. On the head itself nothing is made or changed: its
        account may not, and the controller made all of it."""
        if self._on_head:
            if not self._key_path().exists():
                raise ProviderError(f"gcp: the cluster's SSH key is missing on the head "
                                    f"({self._key_path()})")
            return
        self.refuse_os_login()  # before anything is made
        self.prepare_storage()
        self._ensure_head_identity()
        super().prepare()

    # ----------------------------------------------------------------- head and cleanup

    def ensure_head(self) -> HeadInfo:
        """A small standard (non-spot) VM labelled role=head, created once, then reused,
        running `spotctl head` (started over SSH if not running; token uploaded 0600).
        Nodes use its internal address; the controller `public_url` (external address)."""
        name = head_name(self.cluster)
        heads = [
            vm
            for vm in self._raw_list(
                **{LABEL_CLUSTER: label_value(self.cluster), LABEL_ROLE: "head"}
            )
        ]
        live = [vm for vm in heads if _STATES.get(str(vm.status)) in ("running", "pending")]
        if self._on_head:
            # the head's own loop: this VM is the head; nothing to start or reach by SSH
            own = [vm for vm in live if vm.name == self._on_head]
            if not own:
                raise ProviderError(f"gcp: the head {self._on_head} is not running")
            self._head = self._nodes.head(self._to_instance(own[0]), False, "gcp")
            return self._head
        if not live:
            # A stopped head lost its in-memory store anyway: replace it.
            self._delete((_short(vm.zone), vm.name) for vm in heads)
            # it runs as its own account: made first
            self.prepare_storage()
            self._ensure_head_identity()
            zone = self._head_zone()
            resource = self._instance_resource(
                name=name,
                zone=zone,
                machine_type=self.spec.head_machine_type,
                role="head",
                rid=HEAD_REQUEST_ID,
                spot=False,
            )
            op = self._insert(zone, resource, f"{name}/head")
            if op is not None:
                err = self._wait(op, f"create head {name} in {zone}", zone)
                if err is not None:
                    raise err
            vm = self._get_vm(zone, name)
        else:
            vm = live[0]
        head = self._to_instance(vm)
        self._pin_host_keys(head, fresh=not live)
        self._head = start_new_head(
            lambda: self._nodes.head(head, self._head_process, "gcp"), head.id,
            self.terminate, created=not live,
        )
        return self._head

    def bootstrap(
        self, instances: Sequence[Instance], progress: HostProgress | None = None
    ) -> builtins.list[HostResult]:
        """Make launched workers nodes over SSH: wait until each runs with an address,
        start its agent (GCP metadata notices), confirm its first heartbeat at the head.
        Per-host results; one host failing never hides the others."""
        head = self._head or self.ensure_head()
        # The agents' checkpoint_dir: the cluster's gs:// prefix unless the spec set one
        # (on the head, the spec `up` gave it has it).
        if not self._on_head:
            self.prepare_storage()
        want = {i.id for i in instances}
        deadline = time.monotonic() + self.op_timeout_s
        while True:
            now = {i.id: i for i in self.list(self.cluster) if i.id in want}
            ready = [i for i in now.values() if i.state == "running" and i.address]
            if len(ready) == len(want) or time.monotonic() >= deadline:
                break
            time.sleep(self.poll_s)
        missing = [
            HostResult(i, False, f"gcp: {i} not running with an address", False, 0.0)
            for i in sorted(want - {i.id for i in ready})
        ]
        for inst in ready:
            self._pin_host_keys(inst)
        return self._nodes.bootstrap(ready, head, progress=progress, failed=missing)

    def guest_host_keys(self, zone: str, name: str) -> builtins.list[tuple[str, str]]:
        """The VM's SSH host keys from its guest attributes (hostkeys/), [] until the
        guest agent has published them."""
        from google.cloud import compute_v1

        req = compute_v1.GetGuestAttributesInstanceRequest(
            project=self.project, zone=zone, instance=name, query_path="hostkeys/"
        )
        attrs = self._call(
            f"read host keys of {name}",
            partial(self.clients.instances.get_guest_attributes, request=req, retry=None),
            missing_ok=True,
        )
        items = list(attrs.query_value.items) if attrs is not None and attrs.query_value else []
        return [(str(i.key), str(i.value)) for i in items if i.namespace == "hostkeys"]

    def _pin_host_keys(self, inst: Instance, fresh: bool = True) -> None:
        """Pin the keys the cloud reports for this VM before the first SSH (not under
        the loopback test seam, where one sshd stands in for every VM)."""
        # the head's own loop reaches nodes at their internal address (CloudNodes.target)
        address = inst.address if self._on_head else inst.public_address
        if self._nodes.override is not None or not address:
            return
        wait_s, poll_s = wait_settings(self.ctx.options)
        pin_published(self.ctx.cluster_dir.known_hosts, address,
                      lambda: self.guest_host_keys(inst.zone, inst.id),
                      fresh=fresh, wait_s=wait_s, poll_s=poll_s)

    def _head_zone(self) -> str:
        if self.spec.zones:
            return self.spec.zones[0]
        zones = sorted({r.zone for r in catalog_gcp.rows(self.region)})
        if not zones:
            raise SpecError(f"gcp.region: no known zones in {self.region!r}; set gcp.zones")
        return zones[0]

    def cleanup(self) -> builtins.list[str]:
        """Delete every VM and firewall rule of the cluster, and the workers' service
        account and its bucket bindings; the checkpoints stay unless purged
        (ctx.options["purge"]). Describe anything still there."""
        label = {LABEL_CLUSTER: label_value(self.cluster)}
        td = Teardown()
        if self._nodes.override is not None:
            # Test seam: the "VMs" are processes behind one sshd; stop them as deleting
            # the VMs would.
            insts = td.step("list the cluster's VMs", lambda: self.list(self.cluster), [])
            td.leaks += [f"{r.node_id}: {r.reason}"
                         for r in self._nodes.release(insts) if not r.ok]
        vms = td.step("list the cluster's VMs", lambda: self._raw_list(**label), [])
        td.step("delete VMs", lambda: self._delete((_short(vm.zone), vm.name) for vm in vms))
        # a launch that was in flight while the list was made (the head's own loop, cut
        # short by its own end) shows up now: it goes too
        first = {vm.name for vm in vms}
        late = td.step("look for VMs launched meanwhile",
                       lambda: [i for i in self.list(self.cluster) if i.id not in first], [])
        if late:
            if self._nodes.override is not None:  # (the seam, as above)
                td.leaks += [f"{r.node_id}: {r.reason}"
                             for r in self._nodes.release(late) if not r.ok]
            td.step("delete VMs launched meanwhile",
                    lambda: self._delete((i.zone, i.id) for i in late))
        td.step("delete firewall rules",
                lambda: self._delete_firewalls(firewall_names(self.cluster)))
        # placement policies, after their VMs (a policy in use cannot go)
        td.step("delete placement policies", self._delete_policies)
        td.leaks += [f"instance {_short(vm.zone)}/{vm.name} ({vm.status})"
                     for vm in td.step("list VMs left", lambda: self._raw_list(**label), [])]
        td.leaks += [f"firewall {fw.name}"
                     for fw in td.step("list firewall rules left", self._list_firewalls, [])]
        td.leaks += [f"resource policy {p.name}"
                     for p in td.step("list placement policies left", self._list_policies, [])]
        td.leaks += td.step("the workers' service account", self._delete_node_identity, [])
        if self.ctx.options.get("purge"):
            def purge() -> None:
                self.purged = self.purge_checkpoints()  # reported by `down --purge`

            td.step("purge checkpoints", purge)
        leaks = td.leaks
        if not leaks:
            # nothing of the cluster is left that its key could reach
            key = self._key_path()
            key.unlink(missing_ok=True)
            key.with_suffix(".pub").unlink(missing_ok=True)
        return leaks


def create(ctx: ProviderContext) -> GcpProvider:
    return GcpProvider(ctx)
