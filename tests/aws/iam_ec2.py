"""IAM's authorization of EC2 calls, in front of moto (which judges EC2 calls by action
against the resource "*" only, and counts any Allow with a condition as a Deny).

`IamEc2Proxy` forwards EC2 query-protocol requests to moto and answers those of a
principal it knows (by the access key the request is signed with) with EC2's own
`UnauthorizedOperation` when that principal's policy does not allow every resource the
call touches, as AWS evaluates it:

- RunInstances authorizes each resource it uses or creates separately: the instance, its
  volumes, the image, the subnet, the network interface, each security group, the key
  pair, the placement group, the spot request; iam:PassRole on the instance profile's
  role; ec2:CreateTags for each resource type tagged at launch, with
  `ec2:CreateAction = RunInstances`. (EC2 API reference, "Granting required permissions
  for Amazon EC2 resources"; EC2 User Guide, "Example policies to control access the
  Amazon EC2 API", section "Launch instances (RunInstances)".)
- The condition keys each resource carries there (Service Authorization Reference,
  "Actions, resources, and condition keys for Amazon EC2"): instance `ec2:InstanceType`
  and `aws:RequestTag/<key>`; volume `aws:RequestTag/<key>`; image `ec2:Owner` (the
  owner's alias, "amazon" for AWS's and Canonical's public images, else its account id);
  subnet `ec2:Vpc` (the VPC's ARN) and `ec2:AvailabilityZone`; network interface
  `ec2:Subnet` and `ec2:Vpc`; security group, key pair and placement group
  `ec2:ResourceTag/<key>` (or `aws:ResourceTag/<key>`) and `ec2:Vpc` (groups).
- TerminateInstances and GetConsoleOutput: each instance, with `ec2:ResourceTag/<key>`
  and `ec2:InstanceType`.
- Any other EC2 action: allowed when a statement names it (its resource and conditions
  are not evaluated here: moto's level).

Evaluation (IAM User Guide, "Policy evaluation logic" and "IAM JSON policy elements:
Condition operators"): an explicit Deny wins, else an Allow whose Action, Resource and
every condition match; conditions in one block are ANDed, the values of one key ORed; a
key missing from the request fails every operator but `Null` and `...IfExists`; policy
variables `${aws:PrincipalAccount}` are substituted.
"""

from __future__ import annotations

import fnmatch
import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs

import boto3

from tests.aws.proxying import forward, serve

Ctx = dict[str, list[str]]

DENIED = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<Response><Errors><Error>'
    "<Code>UnauthorizedOperation</Code><Message>You are not authorized to perform this "
    "operation. {why}</Message></Error></Errors><RequestID>{rid}</RequestID></Response>"
)


def _like(pattern: str, value: str, *, case: bool = True) -> bool:
    rx = fnmatch.translate(pattern)  # IAM: * any run, ? one character
    return re.match(rx, value, 0 if case else re.IGNORECASE) is not None


def _listed(v: Any) -> list[str]:
    return [v] if isinstance(v, str) else [str(x) for x in v]


def _condition(op: str, key: str, wanted: list[str], ctx: Ctx) -> bool:
    have = ctx.get(key)
    if op == "Null":
        return (have is None) == (wanted[0].lower() == "true")
    if op.endswith("IfExists"):
        if have is None:
            return True
        op = op.removesuffix("IfExists")
    if have is None:
        return op.startswith(("StringNot", "ArnNot"))  # a negated operator on no value
    if op in ("StringEquals", "ArnEquals"):
        return any(h == w for h in have for w in wanted)
    if op in ("StringLike", "ArnLike"):
        return any(_like(w, h) for h in have for w in wanted)
    if op in ("StringNotEquals", "ArnNotEquals"):
        return not any(h == w for h in have for w in wanted)
    if op in ("StringNotLike", "ArnNotLike"):
        return not any(_like(w, h) for h in have for w in wanted)
    if op == "Bool":
        return any(h.lower() == w.lower() for h in have for w in wanted)
    raise AssertionError(f"condition operator {op} not modelled")


def allows(policy: dict[str, Any], action: str, resource: str, ctx: Ctx,
           account: str) -> bool:  # fmt: skip
    """Whether identity policy `policy` lets `action` on `resource` with context `ctx`
    (resource "": an action whose resources are not modelled, allowed where named)."""

    def applies(st: dict[str, Any]) -> bool:
        if not any(_like(a, action, case=False) for a in _listed(st["Action"])):
            return False
        if resource == "":  # an action not modelled: named is enough (moto's level)
            return True
        if not any(_like(r, resource) for r in _listed(st["Resource"])):
            return False
        for op, block in (st.get("Condition") or {}).items():
            for key, vals in block.items():
                vals = [v.replace("${aws:PrincipalAccount}", account) for v in _listed(vals)]
                if not _condition(op, key, vals, ctx):
                    return False
        return True

    sts = policy["Statement"]
    if any(st["Effect"] == "Deny" and applies(st) for st in sts):
        return False
    return any(st["Effect"] == "Allow" and applies(st) for st in sts)


def _numbered(form: dict[str, str], prefix: str) -> list[str]:
    """Values of `prefix.1`, `prefix.2`, ... in an EC2 query form."""
    out, n = [], 1
    while f"{prefix}.{n}" in form:
        out.append(form[f"{prefix}.{n}"])
        n += 1
    return out


def _tags(form: dict[str, str], kind: str) -> dict[str, str]:
    """The tags a RunInstances form asks for resources of `kind` (TagSpecification.N)."""
    n = 1
    while (rt := form.get(f"TagSpecification.{n}.ResourceType")) is not None:
        if rt == kind:
            out, m = {}, 1
            while (k := form.get(f"TagSpecification.{n}.Tag.{m}.Key")) is not None:
                out[k] = form.get(f"TagSpecification.{n}.Tag.{m}.Value", "")
                m += 1
            return out
        n += 1
    return {}


def _request_tags(tags: dict[str, str]) -> Ctx:
    ctx: Ctx = {f"aws:RequestTag/{k}": [v] for k, v in tags.items()}
    if tags:
        ctx["aws:TagKeys"] = list(tags)
    return ctx


def _resource_tags(tags: Iterable[dict[str, str]] | None) -> Ctx:
    """EC2 takes a resource's tags under both prefixes."""
    return {f"{p}:ResourceTag/{t['Key']}": [t["Value"]] for t in tags or [] for p in ("ec2", "aws")}


@dataclass
class IamEc2Proxy:
    upstream: str  # moto's URL
    region: str
    account: str
    policies: dict[str, dict[str, Any]] = field(default_factory=dict)  # access key -> policy
    refused: list[tuple[str, str]] = field(default_factory=list)  # (action, why)
    allowed: list[str] = field(default_factory=list)  # actions let through, of known keys
    url: str = ""
    _server: ThreadingHTTPServer | None = None

    def __post_init__(self) -> None:
        kw = {"region_name": self.region, "endpoint_url": self.upstream,
              "aws_access_key_id": "testing", "aws_secret_access_key": "testing"}  # fmt: skip
        self._ec2 = boto3.client("ec2", **kw)
        self._iam = boto3.client("iam", **kw)

    # -- what moto knows about the resources a request names
    def _arn(self, kind: str, rid: str) -> str:
        return f"arn:aws:ec2:{self.region}:{self.account}:{kind}/{rid}"

    def _subnet(self, sid: str) -> tuple[str, Ctx]:
        n = self._ec2.describe_subnets(SubnetIds=[sid])["Subnets"][0]
        return self._arn("subnet", sid), {
            "ec2:Vpc": [self._arn("vpc", n["VpcId"])],
            "ec2:AvailabilityZone": [n["AvailabilityZone"]], **_resource_tags(n.get("Tags"))}

    def _default_subnet(self, zone: str) -> str:
        flt = [{"Name": "default-for-az", "Values": ["true"]}]
        if zone:
            flt.append({"Name": "availability-zone", "Values": [zone]})
        return str(self._ec2.describe_subnets(Filters=flt)["Subnets"][0]["SubnetId"])

    def _items(self, action: str, form: dict[str, str]) -> list[tuple[str, str, Ctx]]:
        """(action, resource ARN, context) for each authorization the call needs."""
        if action in ("TerminateInstances", "GetConsoleOutput"):
            ids = _numbered(form, "InstanceId") or [form.get("InstanceId", "")]
            out = []
            for r in self._ec2.describe_instances(InstanceIds=ids)["Reservations"]:
                for i in r["Instances"]:
                    out.append((f"ec2:{action}", self._arn("instance", i["InstanceId"]), {
                        "ec2:InstanceType": [i["InstanceType"]],
                        **_resource_tags(i.get("Tags"))}))  # fmt: skip
            return out
        if action != "RunInstances":
            return [(f"ec2:{action}", "", {})]
        run = "ec2:RunInstances"
        items: list[tuple[str, str, Ctx]] = []
        inst_tags, vol_tags = _tags(form, "instance"), _tags(form, "volume")
        items.append((run, self._arn("instance", "*"), {
            "ec2:InstanceType": [form["InstanceType"]], **_request_tags(inst_tags)}))
        items.append((run, self._arn("volume", "*"), _request_tags(vol_tags)))
        img = self._ec2.describe_images(ImageIds=[form["ImageId"]])["Images"][0]
        items.append((run, f"arn:aws:ec2:{self.region}::image/{form['ImageId']}",
                      {"ec2:Owner": [img.get("ImageOwnerAlias") or img["OwnerId"]]}))
        groups = _numbered(form, "SecurityGroupId")
        subnet = form.get("SubnetId", "")
        if "NetworkInterface.1.DeviceIndex" in form or "NetworkInterface.1.SubnetId" in form:
            n = 1
            while any(k.startswith(f"NetworkInterface.{n}.") for k in form):
                subnet = form.get(f"NetworkInterface.{n}.SubnetId", subnet)
                groups += _numbered(form, f"NetworkInterface.{n}.SecurityGroupId")
                n += 1
        subnet = subnet or self._default_subnet(form.get("Placement.AvailabilityZone", ""))
        sarn, sctx = self._subnet(subnet)
        items.append((run, sarn, sctx))
        items.append((run, self._arn("network-interface", "*"),
                      {"ec2:Subnet": [sarn], "ec2:Vpc": sctx["ec2:Vpc"]}))
        for g in self._ec2.describe_security_groups(GroupIds=groups)["SecurityGroups"] \
                if groups else []:  # fmt: skip
            items.append((run, self._arn("security-group", g["GroupId"]), {
                "ec2:Vpc": [self._arn("vpc", g["VpcId"])], **_resource_tags(g.get("Tags"))}))
        if key := form.get("KeyName"):
            k = self._ec2.describe_key_pairs(KeyNames=[key])["KeyPairs"][0]
            items.append((run, self._arn("key-pair", key), _resource_tags(k.get("Tags"))))
        if pg := form.get("Placement.GroupName"):
            g = self._ec2.describe_placement_groups(GroupNames=[pg])["PlacementGroups"][0]
            items.append((run, self._arn("placement-group", pg), _resource_tags(g.get("Tags"))))
        if form.get("InstanceMarketOptions.MarketType") == "spot":
            items.append((run, self._arn("spot-instances-request", "*"), {}))
        if prof := form.get("IamInstanceProfile.Name"):
            for role in self._iam.get_instance_profile(
                    InstanceProfileName=prof)["InstanceProfile"]["Roles"]:  # fmt: skip
                items.append(("iam:PassRole", role["Arn"],
                              {"iam:PassedToService": ["ec2.amazonaws.com"]}))
        for kind, tags in (("instance", inst_tags), ("volume", vol_tags)):
            if tags:
                items.append(("ec2:CreateTags", self._arn(kind, "*"),
                              {"ec2:CreateAction": ["RunInstances"], **_request_tags(tags)}))
        return items

    def refusal(self, key: str, form: dict[str, str]) -> str:
        """Why the principal of access key `key` may not make this call ("" = it may)."""
        policy = self.policies.get(key)
        if policy is None:
            return ""
        for act, res, ctx in self._items(form.get("Action", ""), form):
            if not allows(policy, act, res, ctx, self.account):
                return f"{act} on {res} ({ctx})"
        return ""

    def start(self) -> IamEc2Proxy:
        proxy = self
        upstream = self.upstream

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                form = {k: v[0] for k, v in parse_qs(raw.decode()).items()}
                m = re.search(r"Credential=([^/]+)/", self.headers.get("Authorization", ""))
                key = m.group(1) if m else ""
                why = proxy.refusal(key, form)
                if why:
                    proxy.refused.append((form.get("Action", ""), why))
                    body = DENIED.format(why=why.replace("<", "").replace("&", ""),
                                         rid=uuid.uuid4()).encode()  # fmt: skip
                    self.send_response(403)
                    self.send_header("Content-Type", "text/xml")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                if key in proxy.policies:
                    proxy.allowed.append(form.get("Action", ""))
                forward(self, upstream, raw)

        self._server, self.url = serve(Handler)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
