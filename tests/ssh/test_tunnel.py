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
