"""The controller reaches a cloud head's API through an SSH forward (spotctl.remote.tunnel):
real sshd on loopback, real head; host keys pinned in the cluster's known_hosts."""

from __future__ import annotations

import json
import urllib.request

import pytest

from spotctl.remote.tunnel import local_url

pytestmark = [pytest.mark.ssh, pytest.mark.timeout(120)]


def test_head_api_through_ssh_forward(tmp_path, sshd, client_key, head):
    known = tmp_path / "known_hosts"
    port = int(head.url.rsplit(":", 1)[1])
    tunnel = {"address": "127.0.0.1", "port": sshd.port, "user": "root",
              "key_file": str(client_key), "remote_port": port}
    url = local_url(tunnel, known)
    assert url != head.url and url.startswith("http://127.0.0.1:")
    assert local_url(tunnel, known) == url  # one forward per process, reused
    req = urllib.request.Request(url + "/api/health")
    req.add_header("Authorization", f"Bearer {head.token}")
    with urllib.request.urlopen(req, timeout=10) as r:
        assert json.load(r)["ok"] is True
    assert sshd.host_pub in known.read_text()  # first contact pinned the key
    bad = urllib.request.Request(url + "/api/status")  # the token still guards the API
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(bad, timeout=10)
    assert e.value.code == 401


def test_reverse_forwards_bound_beyond_loopback_are_refused(tmp_path, sshd_factory,
                                                             client_key):
    """An ssh host whose sshd binds remote forwards on every interface (GatewayPorts yes)
    would open the head's store and Lighthouse to its network: the reverse tunnel
    refuses to come up, with one line saying why; the default sshd's loopback is fine."""
    from spotctl.errors import BootstrapError
    from spotctl.remote import revtunnel

    def spec(s, name):
        return revtunnel.TunnelSpec(
            name=name, address="127.0.0.1", port=s.port, user="root",
            key_file=str(client_key), known_hosts=str(tmp_path / "known_hosts"),
            local_api=1, local_store=2)

    base = tmp_path / "tunnels"
    ok = sshd_factory.start()
    try:
        revtunnel.ensure_ports(base, spec(ok, "loopback"))
    finally:
        revtunnel.stop(base, "loopback")
    open_ = sshd_factory.start(config="GatewayPorts yes\n")
    with pytest.raises(BootstrapError, match="GatewayPorts") as e:
        revtunnel.ensure_ports(base, spec(open_, "open"), timeout_s=60)
    assert "\n" not in str(e.value)


def test_exposed_reads_proc_net_tcp():
    from spotctl.remote.revtunnel import _exposed

    listing = (
        "  sl  local_address rem_address   st\n"
        "   0: 0100007F:1F90 00000000:0000 0A\n"  # 127.0.0.1:8080 listening
        "   1: 00000000:1F91 00000000:0000 0A\n"  # 0.0.0.0:8081 listening
        "   2: 0100007F:1F92 0100007F:D431 01\n"  # an established connection
        "   3: 00000000000000000000000001000000:1F93 0000:0000 0A\n"  # [::1]:8083
        "   4: 00000000000000000000000000000000:1F94 0000:0000 0A\n"  # [::]:8084
    )
    assert _exposed(listing, [8080, 8081, 8082, 8083, 8084]) == [
        "8081 on every interface", "8084 on every interface"]
