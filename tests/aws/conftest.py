"""AWS test rig: moto in server mode over HTTP, and a fault proxy in front of it.

moto never raises capacity, quota, auth or throttling errors, so `FaultProxy` forwards
EC2 query-protocol requests to moto and answers chosen ones with a real EC2 error body
instead (matched by Action and a substring of the form body, e.g. the zone).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import pytest

from tests.aws.proxying import forward, serve
from tests.conftest import CloudFlow, cloud_spec_text

REGION = "us-east-1"
ERROR_XML = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<Response><Errors><Error><Code>{code}</Code>'
    "<Message>{message}</Message></Error></Errors><RequestID>{rid}</RequestID></Response>"
)


@pytest.fixture(scope="session")
def moto_url() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    from tests.aws import ec2_placement

    ec2_placement.install()  # placement groups and EC2's network-interface refusals
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    saved = {k: os.environ.get(k) for k in _ENV_KEYS}
    os.environ.update(
        AWS_ENDPOINT_URL=url,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION=REGION,
        AWS_EC2_METADATA_DISABLED="true",
        AWS_CONFIG_FILE="/nonexistent/aws-config",
        AWS_SHARED_CREDENTIALS_FILE="/nonexistent/aws-credentials",
    )
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
        os.environ.pop(k, None)
    try:
        yield url
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


_ENV_KEYS = (
    "AWS_ENDPOINT_URL",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_DEFAULT_REGION",
    "AWS_EC2_METADATA_DISABLED",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_PROFILE",
    "AWS_SESSION_TOKEN",
)


@pytest.fixture(scope="session")
def ec2(moto_url: str) -> Any:
    import boto3

    return boto3.client("ec2", region_name=REGION, endpoint_url=moto_url)


@pytest.fixture(scope="session")
def ami(ec2: Any) -> str:
    return str(ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"])


# `home` (a fresh SPOTCTL_HOME) is tests/conftest.py's.


HEAD_METADATA = "head"  # the head VM's metadata service, behind the MetadataRouter


def head_role_credentials(moto_url: str, role: str) -> Callable[[], dict[str, str]]:
    """What EC2's metadata service hands the head VM: temporary credentials of the head's
    instance-profile role, from STS."""
    import boto3

    def fetch() -> dict[str, str]:
        sts = boto3.client("sts", region_name=REGION, endpoint_url=moto_url)
        arn = boto3.client("iam", region_name=REGION, endpoint_url=moto_url).get_role(
            RoleName=role)["Role"]["Arn"]  # fmt: skip
        c = sts.assume_role(RoleArn=arn, RoleSessionName="i-head")["Credentials"]
        return {"AccessKeyId": c["AccessKeyId"], "SecretAccessKey": c["SecretAccessKey"],
                "Token": c["SessionToken"],
                "Expiration": c["Expiration"].strftime("%Y-%m-%dT%H:%M:%SZ")}  # fmt: skip

    return fetch


@pytest.fixture
def aws_flow(
    cloud_flow: Callable[..., CloudFlow], moto_url: str, ami: str, metadata_router: Any
) -> Callable[..., CloudFlow]:
    """aws_flow(instance_type, **spec) -> a CloudFlow (tests/conftest.py) of a fresh cluster
    on moto, its instances reached through the loopback sshd. The head's reconcile loop
    gets its credentials as on EC2: from the head's metadata service (IMDSv2, the role
    `up` made for the head), never from this process's environment."""

    def make(instance_type: str = "g5.xlarge", zones: tuple[str, ...] = (f"{REGION}a",),
             **spec: Any) -> CloudFlow:  # fmt: skip
        name = f"flow{uuid.uuid4().hex[:8]}"
        section = (
            f'[aws]\nregion = "{REGION}"\nami = "{ami}"\ninstance_types = ["{instance_type}"]\n'
            f"zones = {json.dumps(list(zones))}\nssh_cidr = \"127.0.0.1/32\"\n"
        )
        head = metadata_router.node(HEAD_METADATA)
        head.set_iam_role(f"spotctl-{name}-head",
                          head_role_credentials(moto_url, f"spotctl-{name}-head"))
        imds = metadata_router.url_template.replace("{node}", HEAD_METADATA)
        return cloud_flow(name, cloud_spec_text(name, section, **spec),
                          {"AWS_ENDPOINT_URL": moto_url,
                           "AWS_EC2_METADATA_SERVICE_ENDPOINT": imds})  # fmt: skip

    return make


def aws_leftovers(name: str, moto_url: str) -> dict[str, list[str]]:
    """What cluster `name` still has on moto: instances in any state but terminated, its
    security groups, key pairs, launch templates and placement groups (by tag), the
    workers' and the head's roles and instance profiles (by name). Empty lists: nothing
    left."""
    import boto3

    ec2 = boto3.client("ec2", region_name=REGION, endpoint_url=moto_url)
    iam = boto3.client("iam", region_name=REGION, endpoint_url=moto_url)
    flt = [{"Name": "tag:spotctl:cluster", "Values": [name]}]
    insts = [i for r in ec2.describe_instances(Filters=flt)["Reservations"]
             for i in r["Instances"]]  # fmt: skip
    idents = (f"spotctl-{name}-node", f"spotctl-{name}-head")
    return {
        "instances": [f"{i['InstanceId']} {i['State']['Name']}" for i in insts
                      if i["State"]["Name"] != "terminated"],  # fmt: skip
        "security_groups": [g["GroupId"] for g in
                            ec2.describe_security_groups(Filters=flt)["SecurityGroups"]],
        "key_pairs": [k["KeyName"] for k in ec2.describe_key_pairs(Filters=flt)["KeyPairs"]],
        "launch_templates": [t["LaunchTemplateId"] for t in
                             ec2.describe_launch_templates(Filters=flt)["LaunchTemplates"]],
        "placement_groups": [g["GroupName"] for g in
                             ec2.describe_placement_groups(Filters=flt)["PlacementGroups"]],
        "roles": [r["RoleName"] for r in iam.list_roles()["Roles"] if r["RoleName"] in idents],
        "instance_profiles": [p["InstanceProfileName"] for p in
                              iam.list_instance_profiles()["InstanceProfiles"]
                              if p["InstanceProfileName"] in idents],
    }  # fmt: skip


# head_process off: these fake instances have no SSH (tests/aws/test_up_flow.py has one).
FAST = {"poll_s": 0.01, "retry_base_s": 0.001, "wait_timeout_s": 10.0, "head_process": False}


@pytest.fixture
def make_provider(moto_url: str, ami: str, home: Path) -> Callable[..., Any]:
    """Build an AwsProvider for a fresh cluster name (moto's state is session-wide)."""
    from spotctl.providers import ProviderContext
    from spotctl.providers.aws.provider import create
    from spotctl.spec import ClusterSpec
    from spotctl.state import Store

    store = Store()

    def make(name: str | None = None, options: dict[str, Any] | None = None, **aws: Any) -> Any:
        name = name or f"t{uuid.uuid4().hex[:10]}"
        section = {"region": REGION, "ami": ami, "ssh_cidr": "198.51.100.7/32", **aws}
        spec = ClusterSpec.model_validate({"name": name, "provider": "aws", "aws": section})
        ctx = ProviderContext(
            cluster=name,
            spec=spec,
            cluster_dir=store.cluster_dir(name).ensure(),
            options={**FAST, **(options or {})},
        )
        return create(ctx)

    return make


@dataclass
class Rule:
    action: str  # EC2 Action, e.g. "RunInstances"
    code: str  # error code to answer with
    status: int = 400
    match: str = ""  # substring of the decoded form body, e.g. "us-east-1a"
    times: int = -1  # how many requests to fail; -1 = all


@dataclass
class FaultProxy:
    """Forwards to moto; answers requests matching a rule with an EC2 error instead."""

    upstream: str
    rules: list[Rule] = field(default_factory=list)
    seen: list[tuple[str, str, bool]] = field(default_factory=list)  # (action, body, faulted)
    url: str = ""
    _server: ThreadingHTTPServer | None = None

    def calls(self, action: str, faulted: bool | None = None) -> list[str]:
        return [b for a, b, f in self.seen if a == action and (faulted is None or f == faulted)]

    def _pick(self, action: str, body: str) -> Rule | None:
        for r in self.rules:
            if r.action == action and r.match in body and r.times != 0:
                if r.times > 0:
                    r.times -= 1
                return r
        return None

    def start(self) -> FaultProxy:
        proxy = self
        upstream = self.upstream

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                form = parse_qs(raw.decode())
                action = form.get("Action", [""])[0]
                body = " ".join(f"{k}={v[0]}" for k, v in form.items())
                rule = proxy._pick(action, body)
                proxy.seen.append((action, body, rule is not None))
                if rule is not None:
                    payload = ERROR_XML.format(
                        code=rule.code, message=f"injected {rule.code}", rid=uuid.uuid4()
                    ).encode()
                    self.send_response(rule.status)
                    self.send_header("Content-Type", "text/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                forward(self, upstream, raw)

        self._server, self.url = serve(Handler)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


@pytest.fixture
def fault_proxy(moto_url: str) -> Iterator[FaultProxy]:
    proxy = FaultProxy(upstream=moto_url).start()
    try:
        yield proxy
    finally:
        proxy.stop()
