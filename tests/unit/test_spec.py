from __future__ import annotations

from pathlib import Path

import pytest

from spotctl.errors import SpecError
from spotctl.spec import ClusterSpec, GpuRange, load_spec, parse_gpu_range


@pytest.mark.parametrize("text,lo,hi", [("8..64", 8, 64), ("4", 4, 4), (" 2 .. 3 ", 2, 3), (5, 5, 5)])
def test_gpu_range_parses(text, lo, hi):
    assert parse_gpu_range(text) == GpuRange(min=lo, max=hi)


@pytest.mark.parametrize("text,needle", [
    ("4..2", "inverted"), ("0", "positive"), ("0..4", "positive"), ("a..b", "MIN..MAX"),
    ("", "MIN..MAX"), ("-1..3", "MIN..MAX"), ("1..2..3", "MIN..MAX"), ("1..20000", "10000"),
    (True, "expected"),
])
def test_gpu_range_rejects(text, needle):
    with pytest.raises(ValueError, match=needle):
        parse_gpu_range(text)


def _write(tmp: Path, body: str, script: bool = True) -> Path:
    if script:
        (tmp / "train.py").write_text("print('hi')\n")
    p = tmp / "spotctl.toml"
    p.write_text(body)
    return p


def test_spec_file_and_flag_override(tmp_path):
    p = _write(tmp_path, 'name = "a"\ngpus = "2..4"\n[train]\ncheckpoint_every = 7\n')
    spec = load_spec(p, {"gpus": "3..5", "name": None})
    assert spec.name == "a" and (spec.gpus.min, spec.gpus.max) == (3, 5)
    assert spec.train.checkpoint_every == 7
    assert spec.train.script == str(tmp_path / "train.py")  # made absolute


@pytest.mark.parametrize("body,needle", [
    ('nmae = "x"\n', "nmae: unknown key"),
    ('[train]\nscritp = "x.py"\n', "train.scritp: unknown key"),
    ('gpus = "4..2"\n', "gpus: range 4..2 is inverted"),
    ('gpus = "0"\n', "gpus: range 0..0 must be positive"),
    ('provider = "azure"\n', "provider:"),
    ('name = "Bad Name"\n', "name:"),
    ('[train]\ncheckpoint_every = 0\n', "train.checkpoint_every"),
    ('[budget]\nmax_usd_per_hour = -1\n', "budget.max_usd_per_hour"),
    ('provider = "ssh"\n', "ssh"),
    ('gpus = [1, 2]\n', "gpus"),
    ('name = \n', "not valid TOML"),
    ('[local]\ncapacity = [{ at_s = 10, nodes = 1 }, { at_s = 5, nodes = 2 }]\n', "increasing"),
])
def test_bad_spec_one_line_naming_the_field(tmp_path, body, needle):
    p = _write(tmp_path, body)
    with pytest.raises(SpecError) as e:
        load_spec(p)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg


def test_missing_script_and_file(tmp_path):
    p = _write(tmp_path, 'name = "a"\n', script=False)
    with pytest.raises(SpecError, match="train.script: training script .* not found"):
        load_spec(p)
    with pytest.raises(SpecError, match="not found"):
        load_spec(tmp_path / "nope.toml")


def test_ssh_hosts_on_a_network_need_it_said_to_be_trusted(tmp_path):
    """Several hosts' training listeners bind their addresses, unauthenticated: refused
    in one line until the spec says only they reach those addresses. Hosts on loopback,
    and a single host (its listeners bind loopback), need nothing."""
    two = ('[[ssh.hosts]]\naddress = "10.0.0.1"\n[[ssh.hosts]]\naddress = "gpu2.lab"\n')
    with pytest.raises(SpecError) as e:
        load_spec(_write(tmp_path, f'provider = "ssh"\n{two}'))
    msg = str(e.value)
    assert "\n" not in msg and "10.0.0.1, gpu2.lab" in msg and "trusted_network = true" in msg, msg
    ok = load_spec(_write(tmp_path, f'provider = "ssh"\n[ssh]\ntrusted_network = true\n{two}'))
    assert ok.ssh.trusted_network
    loop = '[[ssh.hosts]]\naddress = "127.0.0.1"\n[[ssh.hosts]]\naddress = "localhost"\n'
    assert len(load_spec(_write(tmp_path, f'provider = "ssh"\n{loop}')).ssh.hosts) == 2
    one = '[[ssh.hosts]]\naddress = "10.0.0.1"\n'
    assert not load_spec(_write(tmp_path, f'provider = "ssh"\n{one}')).ssh.trusted_network
    with pytest.raises(SpecError, match="trusted_network: Input should be a valid boolean"):
        load_spec(_write(tmp_path, f'provider = "ssh"\n[ssh]\ntrusted_network = "yes"\n{one}'))


def test_torchft_refuses_ssh_hosts_of_unequal_gpus(tmp_path):
    """Each node is one torchft replica group and the global batch is split by replica
    rank times the group's size: hosts of 1 and 2 GPUs would train the wrong data. The
    torchrun engine takes them (its rendezvous numbers every rank)."""
    hosts = ('[ssh]\ntrusted_network = true\n'
             '[[ssh.hosts]]\naddress = "10.0.0.1"\ngpus = 1\n'
             '[[ssh.hosts]]\naddress = "10.0.0.2"\ngpus = 2\n')
    p = _write(tmp_path, f'provider = "ssh"\n{hosts}')
    with pytest.raises(SpecError) as e:
        load_spec(p)
    msg = str(e.value)
    assert "\n" not in msg and "same gpus on every ssh host" in msg and "1, 2" in msg, msg
    p = _write(tmp_path, f'provider = "ssh"\n[train]\nengine = "torchrun"\n{hosts}')
    assert [h.gpus for h in load_spec(p).ssh.hosts] == [1, 2]
    same = hosts.replace("gpus = 2", "gpus = 1")
    assert load_spec(_write(tmp_path, f'provider = "ssh"\n{same}')).train.engine == "torchft"


def test_the_head_runs_the_reconcile_loop_on_local_and_cloud_clusters() -> None:
    """[rebalance] on_head: on by default, done by local, aws and gcp clusters' heads; a
    spec keeps its value through the journal (validated again from there); ssh hosts' heads
    run no loop (`up` says that nothing replaces their lost nodes without cron)."""
    local = ClusterSpec.model_validate({"provider": "local"})
    assert local.head_rebalances and local.rebalance.on_head
    assert not ClusterSpec.model_validate(
        {"provider": "local", "rebalance": {"on_head": False}}).head_rebalances
    aws = ClusterSpec.model_validate({"provider": "aws"})
    assert aws.head_rebalances
    assert ClusterSpec.model_validate(aws.model_dump(mode="json")).head_rebalances
    off = ClusterSpec.model_validate({"provider": "aws", "rebalance": {"on_head": False}})
    assert not ClusterSpec.model_validate(off.model_dump(mode="json")).head_rebalances
    assert ClusterSpec.model_validate({"provider": "gcp"}).head_rebalances
    ssh = ClusterSpec.model_validate({"provider": "ssh", "ssh": {"hosts": [
        {"address": "10.0.0.1", "gpus": 1}]}})
    assert ssh.rebalance.on_head and not ssh.head_rebalances
    with pytest.raises(ValueError, match="on_head_interval_s"):
        ClusterSpec.model_validate({"rebalance": {"on_head_interval_s": 1}})

