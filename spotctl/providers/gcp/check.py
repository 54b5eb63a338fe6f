"""GCP provider, pre-flight checks: what a new project lacks before `up` spends anything.

This module owns `spotctl check --provider gcp`: one line each for credentials and the
project, the region, the Spot (preemptible) GPU quota of the region for the GPUs the spec
wants (PREEMPTIBLE_NVIDIA_*_GPUS; GCP falls back to the regular GPU quota where a project
has no preemptible one), the network the firewall rules go on, the worker and head
images (and their minimum disk sizes), and the checkpoint bucket (reachable, to be
created, or blocked).
"""

from __future__ import annotations

from functools import partial

from spotctl.errors import SpecError
from spotctl.providers.checks import Check, run_check
from spotctl.providers.gcp.launch import GcpLaunch
from spotctl.providers.gcp.storage import check_bucket_name

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
        out.append(run_check("image (workers)", lambda: self._check_image(self.spec.image)))
        out.append(run_check("image (head)", lambda: self._check_image(self.spec.head_image)))
        out.append(run_check("checkpoint bucket", self._check_bucket))
        return out

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
        self._clients_or_init()
        how = f"test endpoint {self.endpoint}" if self.endpoint else "application default"
        return f"project {self.project} ({how} credentials)"

    def _region(self) -> object:
        region = self._call(
            f"read region {self.region}",
            partial(self.clients.regions.get, project=self.project, region=self.region, retry=None),
            missing_ok=True,
        )
        if region is None:
            raise SpecError(f"gcp.region: {self.region!r} is not a region of {self.project}")
        return region

    def _check_region(self) -> str:
        region = self._region()
        zones = list(getattr(region, "zones", []))
        return f"{self.region}: {getattr(region, 'status', '?')}, {len(zones)} zones"

    def _check_gpu_quota(self) -> Check:
        name = "spot GPU quota"
        try:
            region = self._region()
            offers = self.offers()
        except SpecError as e:
            return Check(name, False, " ".join(str(e).split()))
        if not offers:
            return Check(name, False, f"no GPU offer in {self.region} matches the spec")
        limits = {str(q.metric): float(q.limit) for q in getattr(region, "quotas", [])}
        need: dict[str, int] = {}  # GPU -> fewest GPUs per VM among the wanted shapes
        for o in offers:
            need[o.gpu_name] = min(o.gpus, need.get(o.gpu_name, o.gpus))
        parts, enough = [], False
        for gpu, gpus in sorted(need.items()):
            metric = GPU_QUOTA_METRICS.get(gpu, "")
            if not metric:
                continue
            spot = f"PREEMPTIBLE_{metric}"
            used = spot if spot in limits else metric
            limit = limits.get(used, 0.0)
            enough = enough or limit >= gpus
            parts.append(f"{used} {limit:g} ({gpus} needed)")
        detail = "; ".join(parts) or "no quota metric known for " + ", ".join(sorted(need))
        if enough:
            return Check(name, True, detail)
        return Check(
            name,
            False,
            detail + f" -- request more in IAM & Admin > Quotas for {self.region}",
        )

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
        return f"network {NETWORK}"

    def _check_image(self, url: str) -> str:
        link, minimum = self._image(url)
        return f"{link.rsplit('/', 1)[-1]} (disk >= {minimum} GB)"
