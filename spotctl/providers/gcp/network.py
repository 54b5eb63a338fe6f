"""GCP provider, network and keys: the cluster's firewall rules and SSH key.

This module owns what a cluster needs before its first VM: the firewall rules (SSH only
from gcp.ssh_cidr or the caller's address; traffic between members only; members are the
VMs running as the cluster's workers' or head's service account, never a network tag),
created, replaced when the controller's address changes, listed and deleted by exact
name; and the cluster's own SSH key (private half 0600) that goes into each VM's
ssh-keys metadata.
"""

from __future__ import annotations

import builtins
import ipaddress
from collections.abc import Iterable
from functools import partial
from pathlib import Path
from typing import Any

from spotctl.errors import SpecError
from spotctl.providers.gcp.api import GcpApi, _is_exists, _short, firewall_names
from spotctl.providers.gcp.storage import SA_DOMAIN, account_id_for, head_account_id_for
from spotctl.state import write_private


class GcpNetwork(GcpApi):
    """Firewall rules and SSH key of the cluster."""

    def prepare(self) -> None:
        """Firewall rules, reconciled on every call: SSH only from the controller's CIDR,
        all ports between members, and everything else to members denied.

        The deny rule outranks the default network's stock rules (default-allow-internal
        lets every VM of the project reach every port; default-allow-ssh opens 22 to the
        world), so the head's store and API answer cluster members only. A rule that
        drifted from what is wanted (edited by hand, or the controller's address changed)
        is replaced, never widened.

        Members are the VMs that run as the cluster's two service accounts
        (targetServiceAccounts / sourceServiceAccounts), not VMs with a network tag: any
        identity that may set tags on some VM of the project could give it the cluster's
        tag, and the head, which may not set tags (storage.py), could not launch a
        member. Running a VM as an account needs iam.serviceAccounts.actAs on it, which
        the head holds on the workers' account alone. (VPC firewall rules: "Filtering by
        service account versus network tag", cloud.google.com/firewall/docs/firewalls; a
        rule takes accounts or tags, never both: Compute API reference, Firewall resource.)
        Nodes reach the head and each other at their internal addresses, which is what a
        source account matches.
        """
        from google.cloud import compute_v1

        cidr = self._ssh_cidr()
        members = self.member_accounts()
        ssh_name, internal_name, deny_name = firewall_names(self.cluster)
        wanted = {
            ssh_name: compute_v1.Firewall(
                name=ssh_name,
                network="global/networks/default",
                direction="INGRESS",
                priority=ALLOW_PRIORITY,
                description=f"spotctl cluster {self.cluster}: SSH from the controller",
                allowed=[compute_v1.Allowed(I_p_protocol="tcp", ports=["22"])],
                source_ranges=[cidr],
                target_service_accounts=members,
            ),
            internal_name: compute_v1.Firewall(
                name=internal_name,
                network="global/networks/default",
                direction="INGRESS",
                priority=ALLOW_PRIORITY,
                description=f"spotctl cluster {self.cluster}: traffic between members",
                # Rendezvous, coordinator API, torchft's Lighthouse (engine torchft) and
                # gloo/NCCL (dynamic ports).
                allowed=[
                    compute_v1.Allowed(I_p_protocol="tcp"),
                    compute_v1.Allowed(I_p_protocol="udp"),
                    compute_v1.Allowed(I_p_protocol="icmp"),
                ],
                source_service_accounts=members,
                target_service_accounts=members,
            ),
            deny_name: compute_v1.Firewall(
                name=deny_name,
                network="global/networks/default",
                direction="INGRESS",
                priority=DENY_PRIORITY,
                description=f"spotctl cluster {self.cluster}: nothing else reaches members",
                denied=[compute_v1.Denied(I_p_protocol="all")],
                source_ranges=["0.0.0.0/0"],
                target_service_accounts=members,
            ),
        }
        have = {fw.name: fw for fw in self._list_firewalls()}
        ops = []
        for name, rule in wanted.items():
            old = have.get(name)
            if old is not None and _rule_key(old) == _rule_key(rule):
                continue
            if old is not None:
                # Drifted (or the controller's address changed): replace, never widen.
                self._delete_firewalls([name])
            ops.append((name, self._insert_firewall(rule)))
        for name, op in ops:
            if op is not None:
                err = self._wait(op, f"create firewall {name}", None)
                if err is not None:
                    raise err

    def member_accounts(self) -> builtins.list[str]:
        """The service accounts the cluster's VMs run as: the workers', the head's."""
        return [f"{a}@{self.project}{SA_DOMAIN}"
                for a in (account_id_for(self.cluster), head_account_id_for(self.cluster))]

    def _insert_firewall(self, rule: Any) -> Any:
        def run() -> Any:
            try:
                return self.clients.firewalls.insert_unary(
                    project=self.project, firewall_resource=rule, retry=None
                )
            except Exception as exc:  # noqa: BLE001
                if _is_exists(exc):
                    return None
                raise

        return self._call(f"create firewall {rule.name}", run)

    def _list_firewalls(self) -> builtins.list[Any]:
        from google.cloud import compute_v1

        names = "|".join(firewall_names(self.cluster))
        # Regex filter (eq), full match: a cluster named "demo" must not see "demo-2"'s rules.
        req = compute_v1.ListFirewallsRequest(project=self.project, filter=f'name eq "({names})"')
        return (
            self._call(
                "list firewalls", lambda: list(self.clients.firewalls.list(request=req, retry=None))
            )
            or []
        )

    def _delete_firewalls(self, names: Iterable[str]) -> None:
        pending = []
        for name in names:
            op = self._call(
                f"delete firewall {name}",
                partial(
                    self.clients.firewalls.delete_unary,
                    project=self.project,
                    firewall=name,
                    retry=None,
                ),
                missing_ok=True,
            )
            if op is not None:
                pending.append((name, op))
        for name, op in pending:
            err = self._wait(op, f"delete firewall {name}", None)
            if err is not None and "RESOURCE_NOT_FOUND" not in str(err):
                raise err

    # ----------------------------------------------------------------- ssh key

    def _key_path(self) -> Path:
        return self.ctx.path / "ssh" / "id_ed25519"

    def _ssh_keys_entry(self) -> str:
        """`user:key comment` for the ssh-keys metadata item."""
        pub = str(self.ctx.options.get("ssh_public_key") or "")
        if not pub:
            pub = self._ensure_key()
        return f"{self.spec.ssh_user}:{pub.strip()}"

    def _ssh_cidr(self) -> str:
        """gcp.ssh_cidr, else the caller's address the CLI passed; never SSH open to all."""
        raw = self.spec.ssh_cidr or str(self.ctx.options.get("ssh_cidr") or "")
        if not raw:
            raise SpecError(
                "gcp.ssh_cidr: not set and the caller's address is unknown; set it to the "
                'address spotctl runs from, e.g. ssh_cidr = "203.0.113.7/32"'
            )
        try:
            return str(ipaddress.ip_network(raw, strict=False))
        except ValueError:
            raise SpecError(f"gcp.ssh_cidr: {raw!r} is not an IP address or CIDR") from None

    def _ensure_key(self) -> str:
        """The cluster's own SSH key (created once, private part 0600)."""
        priv = self._key_path()
        pub = priv.with_suffix(".pub")
        if pub.exists() and priv.exists():
            return pub.read_text().strip()
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        key = Ed25519PrivateKey.generate()
        private_text = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        ).decode()
        public_text = (
            key.public_key()
            .public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
            .decode()
            + f" spotctl-{self.cluster}"
        )
        write_private(priv, private_text)
        pub.write_text(public_text + "\n")
        return public_text


# Lower number = evaluated first. The cluster's allows beat its deny, which beats the
# default network's stock allow rules (priority 65534).
ALLOW_PRIORITY = 900
DENY_PRIORITY = 950


def _rule_key(fw: Any) -> tuple[Any, ...]:
    """What a firewall rule lets through, comparable between the API's and ours."""

    def perms(items: Any) -> tuple[tuple[str, tuple[str, ...]], ...]:
        return tuple(sorted((str(a.I_p_protocol), tuple(sorted(a.ports))) for a in items))

    return (
        _short(str(fw.network)),
        str(fw.direction),
        int(fw.priority),
        perms(fw.allowed),
        perms(fw.denied),
        tuple(sorted(fw.source_ranges)),
        tuple(sorted(fw.source_tags)),
        tuple(sorted(fw.target_tags)),
        tuple(sorted(fw.source_service_accounts)),
        tuple(sorted(fw.target_service_accounts)),
    )
