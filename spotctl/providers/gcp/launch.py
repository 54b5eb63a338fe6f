"""GCP provider, launch: creating, listing and deleting VMs.

This module owns the VM lifecycle calls: listing by label across zones (aggregated list)
and mapping VMs to spotctl Instances; `launch`, idempotent by deterministic names and
insert request ids, which moves the rest of a request to the next zone on zone
exhaustion and stops on any other error; the instance resource (spot scheduling, GPUs,
boot disk, NIC, metadata, the workers' service account); and `terminate` / deletes that treat a gone VM as done.
"""

from __future__ import annotations

import builtins
import json
import random
import time
import uuid
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from spotctl.errors import CapacityError, ProviderError, SpecError, TransientError
from spotctl.providers.base import Instance, Offer
from spotctl.providers.gcp import catalog as catalog_gcp
from spotctl.providers.gcp import placement
from spotctl.providers.gcp.api import (
    _STATES,
    LABEL_CLUSTER,
    LABEL_REQUEST,
    LABEL_ROLE,
    _is_exists,
    _short,
    _timestamp,
    instance_name,
    label_value,
    subnetwork_name,
)
from spotctl.providers.gcp.network import GcpNetwork
from spotctl.providers.gcp.offers import GcpOffers, nic_type_for
from spotctl.providers.gcp.storage import GcpStorage

INSERT_PARALLEL = 16  # inserts in flight at once, per zone


@dataclass
class _Failure:
    """Why some names could not be created in one zone."""

    names: list[str] = field(default_factory=list)
    error: ProviderError | None = None


# the role `up` grants the head's account on each compact placement policy (its own IAM
# policy), for compute.resourcePolicies.use when the head inserts a replacement
HEAD_POLICY_ROLE = "roles/compute.instanceAdmin.v1"


class GcpLaunch(GcpOffers, GcpNetwork, GcpStorage):
    """VMs of the cluster: list, launch, terminate."""

    # ----------------------------------------------------------------- listing

    def _filter(self, **labels: str) -> str:
        terms = [f'labels.{k} = "{v}"' for k, v in labels.items()]
        return terms[0] if len(terms) == 1 else " AND ".join(f"({t})" for t in terms)

    def _raw_list(self, **labels: str) -> builtins.list[Any]:
        """Every VM in the project with these labels, in any zone (aggregated list)."""
        from google.cloud import compute_v1

        req = compute_v1.AggregatedListInstancesRequest(
            project=self.project, filter=self._filter(**labels)
        )

        def run() -> builtins.list[Any]:
            out = []
            for _scope, scoped in self.clients.instances.aggregated_list(request=req, retry=None):
                out.extend(scoped.instances)
            return out

        found = self._call("list instances", run) or []
        for vm in found:
            self._zone_of[vm.name] = _short(vm.zone)
        return found

    def list(self, cluster: str) -> builtins.list[Instance]:
        vms = self._raw_list(**{LABEL_CLUSTER: label_value(cluster)})
        out = [self._to_instance(vm) for vm in vms]
        return [i for i in out if i.state != "gone"]

    def _to_instance(self, vm: Any) -> Instance:
        zone = _short(vm.zone)
        machine = _short(vm.machine_type)
        accel = list(vm.guest_accelerators)
        gpus = sum(int(a.accelerator_count) for a in accel)
        gpu_name = ""
        if not accel and machine in catalog_gcp.BUNDLED:
            gpu_name, gpus = catalog_gcp.BUNDLED[machine]
        elif accel:
            kind = _short(accel[0].accelerator_type)
            gpu_name = next(
                (g for g, a in catalog_gcp.GUEST_ACCELERATORS.items() if a == kind), kind
            )
        row = next(
            (
                r
                for r in catalog_gcp.rows(None)
                if r.zone == zone
                and r.machine_type == machine
                and r.gpus == gpus
                and r.gpu_name == gpu_name
            ),
            None,
        )
        labels = dict(vm.labels)
        spot = str(vm.scheduling.provisioning_model) == "SPOT"
        nic = vm.network_interfaces[0] if vm.network_interfaces else None
        internal = nic.network_i_p if nic else ""
        external = nic.access_configs[0].nat_i_p if nic and nic.access_configs else ""
        return Instance(
            id=vm.name,
            cluster=labels.get(LABEL_CLUSTER, ""),
            role=labels.get(LABEL_ROLE, "worker"),
            zone=zone,
            instance_type=machine,
            gpus=gpus,
            state=_STATES.get(str(vm.status), "pending"),
            request_id=labels.get(LABEL_REQUEST, ""),
            price=(row.spot_price if spot else row.on_demand_price) if row else 0.0,
            on_demand_price=row.on_demand_price if row else 0.0,
            launched_at=_timestamp(vm.creation_timestamp),
            address=internal,
            public_address=external or internal,
            spot=spot,
            ssh_user=self.spec.ssh_user,
            meta={
                # the network the VM was launched with (gvnic-compact, gvnic, virtio; ""
                # for the head)
                "network": labels.get(placement.LABEL_NETWORK, ""),
                "gcp_status": str(vm.status),
                "gpu_name": gpu_name,
                "key_file": str(self._key_path()),
                "project": self.project,
            },
        )

    # ----------------------------------------------------------------- launch

    def launch(self, offer: Offer, count: int, request_id: str) -> builtins.list[Instance]:
        if offer.provider != "gcp":
            raise SpecError(f"gcp: cannot launch a {offer.provider} offer")
        if count <= 0:
            return []
        # Workers run as the cluster's service account, scoped to its checkpoint prefix
        # (storage.py); idempotent, so a launch without `prepare` still gets it.
        self.prepare_storage()
        rid = label_value(request_id)
        existing = [
            self._to_instance(vm)
            for vm in self._raw_list(
                **{LABEL_CLUSTER: label_value(self.cluster), LABEL_REQUEST: rid}
            )
        ]
        existing = [i for i in existing if i.role == "worker"]
        have = {i.id for i in existing}
        wanted = [
            n
            for n in (instance_name(self.cluster, request_id, i) for i in range(count))
            if n not in have
        ]
        launched = list(existing)
        exhausted: builtins.list[str] = []
        last: ProviderError | None = None
        for zone in self._failover_zones(offer):
            delay = self.retry.base_s
            for attempt in range(1, self.retry.attempts + 1):
                if not wanted:
                    break
                created, failure = self._insert_in_zone(zone, offer, wanted, rid, attempt)
                launched.extend(created)
                wanted = failure.names
                if failure.error is None:
                    break
                if isinstance(failure.error, CapacityError):
                    exhausted.append(zone)
                    last = failure.error
                    break
                if isinstance(failure.error, TransientError) and attempt < self.retry.attempts:
                    # e.g. RESOURCE_OPERATION_RATE_EXCEEDED on the inserts' operations: the
                    # same names go again after a backoff, under new insert requestIds (GCP
                    # would answer a reused one with the failed operation).
                    time.sleep(min(delay, self.retry.max_s) * random.uniform(0.5, 1.0))
                    delay *= 2
                    continue
                raise failure.error
        if wanted and not launched:
            raise CapacityError(
                f"gcp: no capacity for {offer.instance_type} ({offer.gpus} x {offer.gpu_name}) "
                f"in {', '.join(exhausted) or offer.zone}" + (f" ({last})" if last else "")
            )
        return launched

    def preview(self, offer: Offer, count: int) -> dict[str, Any]:
        """The instances.insert body `launch(offer, count, ...)` sends for its first VM,
        built by the same code and made as a dry run (nothing created: the request id is
        a placeholder, the compact placement policy is named as `up` would make it, the
        cluster's SSH key shown as a placeholder until `up` makes it). What `check` shows
        and `up --dry-run --json` shows: the Compute API has no dry run for an insert."""
        from google.cloud import compute_v1

        zone = offer.zone
        _, compact = placement.network_for(offer.instance_type, offer.gpus, self.fast_network)
        policy = ""
        if compact:
            region = zone.rsplit("-", 1)[0]
            policy = (f"projects/{self.project}/regions/{region}/resourcePolicies/"
                      f"{placement.policy_name(self.cluster, zone)}")
        priv = self._key_path()
        pub = priv.with_suffix(".pub")
        saved = self.ctx.options.get("ssh_public_key")
        if not saved:
            self.ctx.options["ssh_public_key"] = (
                pub.read_text() if pub.exists() else "(the cluster's SSH key, made by up)")
        try:
            res = self._instance_resource(
                name=instance_name(self.cluster, "preview", 0), zone=zone,
                machine_type=offer.instance_type, role="worker", rid="preview", spot=True,
                accel=self._guest_accelerator(offer), gpus=offer.gpus, policy=policy)
        finally:
            if not saved:
                self.ctx.options.pop("ssh_public_key", None)
        body: dict[str, Any] = json.loads(compute_v1.Instance.to_json(res))
        return {"zone": zone, "count": count, "instance": body}

    def _insert_in_zone(
        self, zone: str, offer: Offer, names: builtins.list[str], rid: str, attempt: int = 1
    ) -> tuple[builtins.list[Instance], _Failure]:
        """Insert `names` in `zone`; wait for all; report what failed and why.

        The first insert goes alone (a zone that is out of capacity says so once, and the
        whole request moves on); the rest are sent in parallel (INSERT_PARALLEL at a time),
        so 64 VMs cost about one insert's latency, not 64.
        """
        accel = self._guest_accelerator(offer)
        pending: builtins.list[tuple[str, Any]] = []
        failure = _Failure()
        _, compact = placement.network_for(offer.instance_type, offer.gpus, self.fast_network)
        # the head ([rebalance] on_head) uses the zone's policy the controller made, on
        # which `up` let the head's account use it (it creates none)
        policy = self._compact_policy(zone) if compact and names else ""

        def insert(name: str) -> Any:
            resource = self._instance_resource(
                name=name,
                zone=zone,
                machine_type=offer.instance_type,
                role="worker",
                rid=rid,
                spot=True,
                accel=accel,
                gpus=offer.gpus,
                policy=policy,
            )
            key = f"{name}/{rid}" + (f"/{attempt}" if attempt > 1 else "")
            return self._insert(zone, resource, key)

        if not names:
            return [], failure
        try:
            pending.append((names[0], insert(names[0])))
        except CapacityError as e:
            # The zone said no: the whole request goes to the next zone now.
            return [], _Failure(names=list(names), error=e)
        rest = names[1:]
        if rest:
            with ThreadPoolExecutor(max_workers=min(INSERT_PARALLEL, len(rest))) as pool:
                futures = [(n, pool.submit(insert, n)) for n in rest]
            for name, fut in futures:
                exc = fut.exception()
                if exc is None:
                    pending.append((name, fut.result()))
                    continue
                if not isinstance(exc, ProviderError):
                    raise exc
                failure.names.append(name)
                # Capacity errors fail over; any other error wins, since it stops the launch.
                if failure.error is None or (
                    isinstance(failure.error, CapacityError) and not isinstance(exc, CapacityError)
                ):
                    failure.error = exc
        created: builtins.list[Instance] = []
        for name, op in pending:
            err = self._wait(op, f"create {name} in {zone}", zone) if op is not None else None
            if err is not None:
                failure.names.append(name)
                # Capacity errors fail over; any other error wins, since it stops the launch.
                if failure.error is None or (
                    isinstance(failure.error, CapacityError) and not isinstance(err, CapacityError)
                ):
                    failure.error = err
                continue
            vm = self._get_vm(zone, name, missing_ok=True)
            if vm is not None:
                self._zone_of[name] = zone
                created.append(self._to_instance(vm))
        return created, failure

    def _insert(self, zone: str, resource: Any, key: str) -> Any:
        """Insert one VM. None when it already exists (a retry of an earlier insert)."""
        from google.cloud import compute_v1

        req = compute_v1.InsertInstanceRequest(
            project=self.project,
            zone=zone,
            instance_resource=resource,
            # Same (name, request) -> same UUID: GCP dedupes a re-sent insert server-side.
            request_id=str(uuid.uuid5(uuid.NAMESPACE_URL, f"spotctl/{self.cluster}/{zone}/{key}")),
        )

        def run() -> Any:
            try:
                return self.clients.instances.insert_unary(request=req, retry=None)
            except Exception as exc:  # noqa: BLE001
                if _is_exists(exc):
                    return None
                raise

        return self._call(f"create {resource.name} in {zone}", run)

    def _instance_resource(
        self,
        *,
        name: str,
        zone: str,
        machine_type: str,
        role: str,
        rid: str,
        spot: bool,
        accel: str = "",
        gpus: int = 0,
        policy: str = "",
    ) -> Any:
        from google.cloud import compute_v1

        if spot:
            scheduling = compute_v1.Scheduling(
                provisioning_model="SPOT",
                # A reclaimed spot VM is deleted, not stopped: nothing to pay for or clean.
                instance_termination_action="DELETE",
                # GPU VMs cannot live-migrate; spot VMs never restart by themselves.
                on_host_maintenance="TERMINATE",
                automatic_restart=False,
            )
        else:
            scheduling = compute_v1.Scheduling(
                provisioning_model="STANDARD",
                on_host_maintenance="MIGRATE",
                automatic_restart=True,
            )
        accelerators = []
        if accel and gpus:
            accelerators.append(
                compute_v1.AcceleratorConfig(
                    accelerator_count=gpus,
                    accelerator_type=f"projects/{self.project}/zones/{zone}/acceleratorTypes/{accel}",
                )
            )
        image, disk_type, disk_gb = self._boot_disk(zone, machine_type, role)
        if role == "worker":
            nic, _ = placement.network_for(machine_type, gpus, self.fast_network)
        else:
            nic = nic_type_for(machine_type)
        metadata = [
            compute_v1.Items(key="ssh-keys", value=self._ssh_keys_entry()),
            # Only the cluster key logs in: no project-wide keys, no OS Login.
            compute_v1.Items(key="block-project-ssh-keys", value="TRUE"),
            compute_v1.Items(key="enable-oslogin", value="FALSE"),
            # The guest agent publishes the VM's SSH host keys (hostkeys/), so the first
            # connection is verified against them rather than trusted (provider.py).
            compute_v1.Items(key="enable-guest-attributes", value="TRUE"),
        ]
        if role == "worker":
            # older Deep Learning VM images install the NVIDIA driver at first boot when
            # asked (newer ones have it: the key is then ignored)
            metadata.append(compute_v1.Items(key="install-nvidia-driver", value="True"))
        return compute_v1.Instance(
            name=name,
            machine_type=f"zones/{zone}/machineTypes/{machine_type}",
            labels={
                LABEL_CLUSTER: label_value(self.cluster),
                LABEL_ROLE: role,
                LABEL_REQUEST: rid,
                **({placement.LABEL_NETWORK: placement.label(nic, bool(policy))}
                   if role == "worker" else {}),
            },
            resource_policies=[policy] if policy else [],
            scheduling=scheduling,
            guest_accelerators=accelerators,
            disks=[
                compute_v1.AttachedDisk(
                    boot=True,
                    auto_delete=True,
                    initialize_params=compute_v1.AttachedDiskInitializeParams(
                        source_image=image, disk_size_gb=disk_gb, disk_type=disk_type
                    ),
                )
            ],
            network_interfaces=[
                compute_v1.NetworkInterface(
                    network="global/networks/default",
                    # named, not left to GCE: the head may use this subnetwork only
                    subnetwork=subnetwork_name(zone.rsplit("-", 1)[0]),
                    access_configs=[
                        compute_v1.AccessConfig(name="External NAT", type_="ONE_TO_ONE_NAT")
                    ],
                    **({"nic_type": nic} if nic else {}),
                )
            ],
            metadata=compute_v1.Metadata(items=metadata),
            service_accounts=self._service_accounts(role),
        )

    # ----------------------------------------------------------------- placement

    def _compact_policy(self, zone: str) -> str:
        """The cluster's compact placement policy for `zone` (created on the first launch
        there, found by name and owned by its description); its URL for instances."""
        from google.cloud import compute_v1

        region = zone.rsplit("-", 1)[0]
        name = placement.policy_name(self.cluster, zone)
        url = f"projects/{self.project}/regions/{region}/resourcePolicies/{name}"
        if zone in self._policies:
            return url
        mine = placement.policy_description(self.cluster)
        got = self._call(f"get resource policy {name}", partial(
            self.clients.resource_policies.get, project=self.project, region=region,
            resource_policy=name, retry=None), missing_ok=True)
        if got is not None and got.description != mine:
            raise SpecError(f"gcp: resource policy {name} exists but is not cluster "
                            f"{self.cluster}'s; delete it or pick another cluster name")
        if self._on_head:
            # the head's account may use the policy (`up` granted it on the policy
            # itself) but not create one: a zone the controller never launched in
            # gets its replacements without compact placement (their label says so)
            if got is None:
                return ""
            self._policies[zone] = name
            return url
        if got is None:
            pol = compute_v1.ResourcePolicy(
                name=name, description=mine,
                group_placement_policy=compute_v1.ResourcePolicyGroupPlacementPolicy(
                    collocation="COLLOCATED"))

            def run() -> Any:
                try:
                    return self.clients.resource_policies.insert_unary(
                        project=self.project, region=region, resource_policy_resource=pol,
                        retry=None)
                except Exception as exc:  # noqa: BLE001 - made meanwhile: ours, by name
                    if _is_exists(exc):
                        return None
                    raise

            op = self._call(f"create resource policy {name}", run)
            if op is not None:
                err = self._wait(op, f"create resource policy {name}", None, region=region)
                if err is not None:
                    raise err
        if self.ctx.spec.head_rebalances:
            self._let_head_use(region, name)
        self._policies[zone] = name
        return url

    def _let_head_use(self, region: str, name: str) -> None:
        """Let the head's account put its replacements in this policy: a binding on the
        policy itself (resourcePolicies.setIamPolicy), so the grant reaches this one
        policy and nothing else (an IAM condition on the project binding cannot name
        resource policies). The role is the instance admin role the head holds on its
        own workers, which includes compute.resourcePolicies.use."""
        from google.cloud import compute_v1

        member = f"serviceAccount:{self.head_account}"
        get = partial(self.clients.resource_policies.get_iam_policy, project=self.project,
                      region=region, resource=name, retry=None)
        pol = self._call(f"read the IAM policy of resource policy {name}", get)
        assert pol is not None
        if any(b.role == HEAD_POLICY_ROLE and member in b.members for b in pol.bindings):
            return
        pol.bindings.append(compute_v1.Binding(role=HEAD_POLICY_ROLE, members=[member]))
        req = compute_v1.RegionSetPolicyRequest(policy=pol)
        self._call(f"let the head use resource policy {name}", partial(
            self.clients.resource_policies.set_iam_policy, project=self.project,
            region=region, resource=name, region_set_policy_request_resource=req, retry=None))

    def _list_policies(self) -> builtins.list[Any]:
        """The cluster's placement policies in its region."""
        mine = placement.policy_description(self.cluster)
        found = self._call("list resource policies", lambda: list(
            self.clients.resource_policies.list(project=self.project, region=self.region,
                                                retry=None))) or []
        return [p for p in found if p.description == mine]

    def _delete_policies(self) -> None:
        pending = []
        for pol in self._list_policies():
            op = self._call(f"delete resource policy {pol.name}", partial(
                self.clients.resource_policies.delete_unary, project=self.project,
                region=self.region, resource_policy=pol.name, retry=None), missing_ok=True)
            if op is not None:
                pending.append((pol.name, op))
        self._policies.clear()
        for name, op in pending:
            err = self._wait(op, f"delete resource policy {name}", None, region=self.region)
            if err is not None and "RESOURCE_NOT_FOUND" not in str(err):
                raise err

    # ----------------------------------------------------------------- terminate

    def terminate(self, ids: Sequence[str]) -> None:
        ids = [i for i in ids if i]
        if not ids:
            return
        if any(i not in self._zone_of for i in ids):
            self._raw_list(**{LABEL_CLUSTER: label_value(self.cluster)})
        self._delete([(self._zone_of[i], i) for i in ids if i in self._zone_of])

    def _delete(self, targets: Iterable[tuple[str, str]]) -> None:
        """Delete (zone, name) pairs; a VM that is already gone is not an error."""
        pending = []
        for zone, name in targets:
            op = self._call(
                f"delete {name}",
                partial(
                    self.clients.instances.delete_unary,
                    project=self.project,
                    zone=zone,
                    instance=name,
                    retry=None,
                ),
                missing_ok=True,
            )
            self._zone_of.pop(name, None)
            if op is not None:
                pending.append((zone, name, op))
        for zone, name, op in pending:
            err = self._wait(op, f"delete {name}", zone)
            if err is not None and "RESOURCE_NOT_FOUND" not in str(err):
                raise err
