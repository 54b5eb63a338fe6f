"""GCP provider, pre-flight checks: what a new project lacks before `up` spends anything.

This module owns `spotctl check --provider gcp`: one line each for credentials and the
project (a disabled Compute Engine API, as on a new project, named with the command that
enables it), the region, the GPU quota of the region that Spot VMs of the GPUs the spec
wants count against: PREEMPTIBLE_NVIDIA_*_GPUS where the project was granted preemptible
quota (its limit is above 0), else the standard NVIDIA_*_GPUS (Compute Engine docs,
"Allocation quotas", preemptible quotas: Spot and preemptible VMs use preemptible quota
where the project has it and standard quota otherwise; Compute Engine lists the
PREEMPTIBLE_ metrics at 0 on a project without such a grant) and the project-wide GPUS_ALL_REGIONS, each as its limit
minus usage against the cluster's gpus.min, the network the firewall rules go on and the
subnetwork its VMs go on, the worker and head images (and their minimum disk sizes), and the checkpoint bucket (reachable, to be
created, or blocked); and, not blocking, the first launch's request and the head's rights
as `up` sends them.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

from spotctl.errors import AuthError, ProviderError, SpecError, SpotctlError
from spotctl.providers.checks import Check, run_check
from spotctl.providers.gcp import placement
from spotctl.providers.gcp.api import subnetwork_name
from spotctl.providers.gcp.launch import GcpLaunch
from spotctl.providers.gcp.storage import (
    ACT_AS_ROLE,
    HEAD_NET_ROLE,
    HEAD_PERMISSIONS,
    HEAD_ROLE_ID,
    check_bucket_name,
)
from spotctl.remote.package import image_torch

# GPU (catalog name) -> Compute Engine quota metric, without the PREEMPTIBLE_ prefix.
GPU_QUOTA_METRICS = {
    "T4": "NVIDIA_T4_GPUS",
    "V100": "NVIDIA_V100_GPUS",
    "L4": "NVIDIA_L4_GPUS",
    "A100": "NVIDIA_A100_GPUS",
    "A100-80GB": "NVIDIA_A100_80GB_GPUS",
    "H100": "NVIDIA_H100_GPUS",
    "H100-MEGA": "NVIDIA_H100_MEGA_GPUS",
    "H200": "NVIDIA_H200_GPUS",
}
NETWORK = "default"


class GcpChecks(GcpLaunch):
    """`checks()`: the project's readiness, one Check per line."""

    def checks(self) -> list[Check]:
        out = [run_check("credentials", self._check_credentials)]
        if not out[0].ok:
            return out
        region = run_check("region", self._check_region)
        out.append(region)
        if region.ok:
            out.append(self._check_gpu_quota())
        out.append(run_check("network", self._check_network))
        out.append(run_check("SSH login", self._check_os_login))
        out.append(run_check("GPU network", self._check_gpu_network))
        out.append(run_check("image (workers)",
                             lambda: self._check_image(self.spec.image, workers=True)))
        out.append(run_check("image (head)", lambda: self._check_image(self.spec.head_image)))
        out.append(self._check_launch())
        out.append(self._check_head_rights())
        out.append(run_check("checkpoint bucket", self._check_bucket))
        return out

    def _check_launch(self) -> Check:
        """The instances.insert body `up` would send for the first plan's launch (the same
        code: preview), for the spec's cluster name. Compute Engine has no dry run for an
        insert, so what can be checked is checked above (image, disk, NIC, quota); whether
        the identity may insert it (IAM, conditions) only a real insert says."""
        name = "launch request"
        try:
            first = self.ctx.options.get("first_launch")
            pick = first(self.offers()) if callable(first) else None
            if pick is None:
                return Check(name, False, "the first plan launches nothing here (no offer "
                             "fits the spec), so no request to show", blocking=False)
            offer, count = pick
            twin = type(self)(replace(self.ctx, cluster=self.ctx.spec.name))
            req = twin.preview(offer, count)
        except SpotctlError as e:
            return Check(name, False, " ".join(str(e).split()))
        inst = req["instance"]
        return Check(name, True, (
            f"the first plan's {count} x {offer.instance_type} (spot) in {offer.zone}: "
            f"{len(inst.get('networkInterfaces', []))} NIC "
            f"({inst['networkInterfaces'][0].get('nicType', 'VirtIO')}), "
            + ("compact placement" if inst.get("resourcePolicies") else "no placement policy")
            + ", runs as " + inst["serviceAccounts"][0]["email"]
            + " (no dry run for an insert: IAM is judged by the first real one)"),
            blocking=False, data={"request": req})

    def _check_bucket(self) -> str:
        """One line: the bucket is reachable, will be created, or what blocks it."""
        bucket = self.bucket_name()
        where = f"gs://{bucket}/{self.prefix}"
        why = check_bucket_name(bucket)
        if why:
            raise SpecError(f"gcp.bucket: {bucket!r} is not a valid bucket name ({why})")
        found = self._get_bucket()  # a bucket we cannot read raises: blocked
        if found is not None:
            ubla = (found.get("iamConfiguration") or {}).get("uniformBucketLevelAccess") or {}
            if not ubla.get("enabled"):
                raise SpecError(
                    f"gcp.bucket: {where} has no uniform bucket-level access (needed for the "
                    "workers' prefix-scoped IAM condition)"
                )
            return f"{where} (bucket reachable)"
        if self.spec.bucket:
            raise SpecError(f"gcp.bucket: bucket {bucket} does not exist (or is not yours)")
        return f"{where} (bucket created on first up: uniform access, no public access)"

    def _check_credentials(self) -> str:
        """Credentials, and a first Compute call: a new project's disabled API shows here."""
        self._clients_or_init()
        how = f"test endpoint {self.endpoint}" if self.endpoint else "application default"
        try:
            self._project_quotas()
        except AuthError as e:
            if "API is disabled" in str(e):
                raise AuthError(f"gcp: project {self.project}: the Compute Engine API is "
                                "disabled (enable it: gcloud services enable "
                                f"compute.googleapis.com --project {self.project})") from None
            raise
        return f"project {self.project} ({how} credentials)"

    def _project_quotas(self) -> dict[str, tuple[float, float]]:
        """Project-wide quotas: metric -> (limit, usage)."""
        proj = self._call(
            f"read project {self.project}",
            partial(self.clients.projects.get, project=self.project, retry=None),
        )
        return {str(q.metric): (float(q.limit), float(q.usage))
                for q in getattr(proj, "quotas", [])}  # fmt: skip

    def _region(self) -> object:
        region = self._call(
            f"read region {self.region}",
            partial(self.clients.regions.get, project=self.project, region=self.region, retry=None),
            missing_ok=True,
        )
        if region is None:
            raise SpecError(f"gcp.region: {self.region!r} is not a region of {self.project}")
        return region

    def _check_os_login(self) -> str:
        if self.refuse_os_login() is None:
            return ("the organization's OS Login policy could not be read "
                    "(orgpolicy.policy.get); where it enforces OS Login, nodes cannot be "
                    "bootstrapped")
        return "metadata SSH keys (OS Login not enforced)"

    def _check_region(self) -> str:
        region = self._region()
        zones = list(getattr(region, "zones", []))
        return f"{self.region}: {getattr(region, 'status', '?')}, {len(zones)} zones"

    def _check_gpu_quota(self) -> Check:
        """Enough GPUs left (limit minus usage) for the cluster's gpus.min, in the region's
        Spot quota of a wanted GPU and in the project-wide GPUS_ALL_REGIONS (0 on a new
        project); each VM brings its whole shape's GPUs."""
        name = "spot GPU quota"
        try:
            region = self._region()
            offers = self.offers()
            project = self._project_quotas()
        except (SpecError, ProviderError) as e:
            return Check(name, False, " ".join(str(e).split()))
        if not offers:
            return Check(name, False, f"no GPU offer in {self.region} matches the spec")
        quotas = {str(q.metric): (float(q.limit), float(getattr(q, "usage", 0.0)))
                  for q in getattr(region, "quotas", [])}  # fmt: skip
        want = max(1, self.ctx.spec.gpus.min)
        need: dict[str, int] = {}  # GPU -> fewest GPUs (whole VMs) that make gpus.min
        for o in offers:
            if o.gpus > 0:
                n = -(-want // o.gpus) * o.gpus
                need[o.gpu_name] = min(n, need.get(o.gpu_name, n))
        all_limit, all_used = project.get("GPUS_ALL_REGIONS", (0.0, 0.0))
        all_free = all_limit - all_used
        parts, region_ok = [], False
        for gpu, gpus in sorted(need.items()):
            metric = GPU_QUOTA_METRICS.get(gpu, "")
            if not metric:
                continue
            spot = f"PREEMPTIBLE_{metric}"
            # Spot VMs count against preemptible quota only where it was granted
            used = spot if quotas.get(spot, (0.0, 0.0))[0] > 0 else metric
            limit, usage = quotas.get(used, (0.0, 0.0))
            ok = limit - usage >= gpus and all_free >= gpus
            region_ok = region_ok or limit - usage >= gpus
            parts.append(f"{used} {limit:g}, {usage:g} in use ({gpus} needed for gpus.min "
                         f"{want})")  # fmt: skip
            if ok:
                return Check(name, True, "; ".join(parts) + f"; GPUS_ALL_REGIONS {all_limit:g}"
                             f", {all_used:g} in use")  # fmt: skip
        fewest = min(need.values(), default=want)
        parts.append(f"GPUS_ALL_REGIONS {all_limit:g}, {all_used:g} in use (project-wide, "
                     f"{fewest} needed)")  # fmt: skip
        fixes = []
        if not region_ok:
            fixes.append(f"the Spot GPU quota of {self.region}")
        if all_free < fewest:
            fixes.append("GPUS_ALL_REGIONS (global)")
        return Check(name, False, "; ".join(parts) + " -- request more in IAM & Admin > "
                     f"Quotas: {' and '.join(fixes) or 'one GPU in both'}")  # fmt: skip

    def _check_network(self) -> str:
        net = self._call(
            f"read network {NETWORK}",
            partial(self.clients.networks.get, project=self.project, network=NETWORK, retry=None),
            missing_ok=True,
        )
        if net is None:
            raise SpecError(
                f"gcp: project {self.project} has no '{NETWORK}' network for the cluster's "
                "VMs and firewall rules (create it: gcloud compute networks create default)"
            )
        sub = subnetwork_name(self.region).rsplit("/", 1)[-1]
        found = self._call(
            f"read subnetwork {sub} in {self.region}",
            partial(self.clients.subnetworks.get, project=self.project, region=self.region,
                    subnetwork=sub, retry=None),
            missing_ok=True,
        )
        if found is None:
            raise SpecError(
                f"gcp: network {NETWORK} has no subnetwork {sub!r} in {self.region}, where "
                "the cluster's VMs go (an auto-mode default network has one in every region)")
        return f"network {NETWORK}, subnetwork {sub} in {self.region}"

    def _check_head_rights(self) -> Check:
        """What `up` grants the head's account ([rebalance] on_head), as it sends it: the
        custom role and its condition on the project, networkUser on the subnetwork,
        serviceAccountUser on the workers' account (storage.py). IAM has no dry run for a
        grant: whether this identity may make them, `up` shows."""
        name = "head's rights"
        if not self.ctx.spec.head_rebalances:
            return Check(name, True, "none: [rebalance] on_head = false (its account gets "
                         "no role and its VM no API scope)", blocking=False)
        sub = subnetwork_name(self.region)
        twin = type(self)(replace(self.ctx, cluster=self.ctx.spec.name))
        grants = {
            "role": {"name": twin.head_role, **twin.head_role_resource()},
            "project": twin.head_bindings(),
            "subnetwork": {"name": sub, "role": HEAD_NET_ROLE},
            "serviceAccount": {"name": twin.node_account, "role": ACT_AS_ROLE},
        }
        return Check(name, True, (
            f"custom role {HEAD_ROLE_ID} ({len(HEAD_PERMISSIONS)} permissions, no "
            "setTags) on the project for this cluster's VMs and disks by name; "
            f"{HEAD_NET_ROLE} on {sub} only; {ACT_AS_ROLE} on {twin.node_account} only"),
            blocking=False, data={"grants": grants})

    def _check_gpu_network(self) -> str:
        """Per wanted shape, the network its workers get (as `up --dry-run` says); where
        that is gVNIC, the worker image must take it (its guestOsFeatures name GVNIC: GCP
        refuses the VM otherwise)."""
        fast = bool(self.ctx.spec.placement.fast_network)
        shapes = sorted({(o.instance_type, o.gpus) for o in self.offers()})
        if not shapes:
            raise SpecError(f"gcp: no wanted machine type is sold in {self.region}")
        gvnic = [t for t, g in shapes if placement.network_for(t, g, fast)[0] == "GVNIC"]
        if gvnic and not self.image_takes_gvnic(self.spec.image):
            raise SpecError(
                f"gcp.image {self.spec.image}: its guestOsFeatures have no GVNIC, and "
                f"{', '.join(gvnic)} get gVNIC (GCP refuses the VM): pick an image that "
                "supports gVNIC (the Deep Learning VM and current Debian/Ubuntu images do)")
        per: dict[str, str] = {}
        for t, g in shapes:  # one line per machine type (a shape's GPUs do not change its NIC)
            per.setdefault(t, placement.describe(t, g, fast))
        return "; ".join(f"{t}: {d}" for t, d in per.items())

    def _check_image(self, url: str, workers: bool = False) -> str:
        link, minimum = self._image(url)
        name = link.rsplit('/', 1)[-1]
        # the workers' torch and driver, as the Deep Learning VM names them
        note = image_torch(name) if workers else ""
        return f"{name} (disk >= {minimum} GB)" + (f"; {note}" if note else "")
