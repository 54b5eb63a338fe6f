"""Claims of the README and the docs pages (docs/) that no other test would catch if they
were false."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.unit.test_coordinator import Clock, hb, w

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
# every page a user reads: the README and the docs site's pages
DOCS = "\n".join([README, *(p.read_text() for p in sorted((REPO / "docs").rglob("*.md")))])
DESIGN = (REPO / "docs" / "design.md").read_text()  # the contributors' page: the test seams
OPERATING = (REPO / "docs" / "operating.md").read_text()  # the exit codes
# Set by spotctl for its own child processes; tests read them to find or drive those.
INTERNAL = {"SPOTCTL_NODE_TAG", "SPOTCTL_ZYGOTE", "SPOTCTL_COMPLETE",
            # the agent's contract with its workers (tests/elastic/ft_harness.py plays it)
            "SPOTCTL_CHECKPOINT_DIR", "SPOTCTL_CHECKPOINT_EVERY", "SPOTCTL_MAX_STEPS",
            "SPOTCTL_CHECKPOINT_EVERY_S", "SPOTCTL_KEEP_LAST", "SPOTCTL_CHECKPOINT_WRITERS",
            "SPOTCTL_ENGINE", "SPOTCTL_FT_REPLICA_ID", "SPOTCTL_NODE_ID", "SPOTCTL_STATUS_DIR",
            "SPOTCTL_FT_REPLICA_NODES",
            # a torchft replica's dense index, torchtitan's replica id (docs/integrations.md)
            "SPOTCTL_FT_REPLICA_INDEX",
            # the notice before a rescale (spotctl.integrations, spotctl.elastic.notice)
            "SPOTCTL_NOTICE_FILE",
            # the agent's contract with its torchrun (tests/unit/test_rdzv_gate.py plays it)
            "SPOTCTL_RDZV_GATE",
            # the cluster's largest size, for micro_batch "auto" (spotctl.elastic)
            "SPOTCTL_MAX_WORLD",
            # [train] sync, sync_every, outer_lr, outer_momentum, on_notice
            # (TrainSpec.worker_env)
            "SPOTCTL_SYNC", "SPOTCTL_SYNC_EVERY", "SPOTCTL_OUTER_LR", "SPOTCTL_OUTER_MOMENTUM",
            "SPOTCTL_ON_NOTICE"}
# Tuning knobs a test sets, documented with the concepts they tune rather than as seams.
KNOBS = {"SPOTCTL_FT_JOIN_TIMEOUT_MS", "SPOTCTL_FT_HEARTBEAT_TIMEOUT_MS", "SPOTCTL_FT_START_REPLICAS",
         "SPOTCTL_CHECKPOINT_STORAGE_OPTIONS", "SPOTCTL_CHECKPOINT_PART_MB",
         "SPOTCTL_UP_STEP_WAIT_S", "SPOTCTL_FT_MIN_REPLICAS",
         # a user's own class in a torchft heal (docs/concepts.md, docs/operating.md)
         "SPOTCTL_FT_HEAL_ALLOW",
         # the cross-replica timeout (docs/concepts.md, docs/reference/spec.md)
         "SPOTCTL_FT_TIMEOUT_S",
         # the controller's address for an unset ssh_cidr (docs/getting-started/aws.md)
         "SPOTCTL_CONTROLLER_ADDRESS",
         # how periodic checkpoints are written (docs/concepts.md, docs/reference/spec.md)
         "SPOTCTL_ASYNC_SAVE",
         # a crash loop's length; `logs` with torch's harmless warnings (issue 62:
         # docs/getting-started/local.md, docs/reference/spec.md)
         "SPOTCTL_CRASH_LIMIT", "SPOTCTL_LOGS_RAW",
         # a plain torchrun script's grace between its notice and SIGTERM
         # (docs/guides/torchrun-script.md)
         "SPOTCTL_NOTICE_GRACE_S",
         # a worker's C heap left as glibc sets it (issue 58: docs/reference/spec.md)
         "SPOTCTL_MALLOC_KEEP"}



def _names(paths: list[Path]) -> set[str]:
    out: set[str] = set()
    for p in paths:
        out |= set(re.findall(r"\bSPOTCTL_[A-Z_]*[A-Z]\b", p.read_text(errors="replace")))
    return out


def test_docs_list_every_test_seam_and_each_is_read_by_the_code() -> None:
    m = re.search(r"Test seams, for tests only:(.*?)\.\n", DESIGN, re.S)
    assert m, "docs/design.md: the 'Test seams, for tests only:' sentence is gone"
    listed = set(re.findall(r"`(SPOTCTL_[A-Z_]+|AWS_[A-Z_]+)", m.group(1)))
    code = _names(list((REPO / "spotctl").rglob("*.py")) + [REPO / "templates" / "train.py"])
    # every seam the tests set on spotctl is in the list...
    used = _names(list((REPO / "tests").rglob("*.py"))) & code
    assert used - INTERNAL - KNOBS <= listed, sorted(used - INTERNAL - KNOBS - listed)
    assert all(k in DOCS for k in KNOBS), sorted(k for k in KNOBS if k not in DOCS)
    # ...and every listed one is still read somewhere
    assert {x for x in listed if x.startswith("SPOTCTL_")} <= code, sorted(listed - code)


def test_a_node_silent_for_4_s_by_default_is_declared_unresponsive() -> None:
    """docs/concepts.md: 'a node that goes silent for 4 s is declared unresponsive and its
    peers' workers are killed' - with the head's own default, not a value the test picks."""
    assert re.search(r"silent for 4 s is declared\s+unresponsive", DOCS)
    import tempfile

    from spotctl.head.server import HeadServer

    for silent, killed in ((3.9, 0), (4.1, 1)):
        clk = Clock()
        with tempfile.TemporaryDirectory() as d:  # the coordinator the head really builds
            c = HeadServer(Path(d), "t", with_store=False).coord
        c.clock = clk
        for n in ("a", "b"):
            hb(c, n, "waiting")
        for i, n in enumerate(("a", "b")):
            hb(c, n, workers=[w(i, "inc1", 30, ws=2, first=999.0)])
        clk.t += silent
        r = hb(c, "a", workers=[w(0, "inc1", 31, ws=2)])
        assert c.kill_gen == killed, (silent, r)
        if killed:
            assert r["kill_incarnation"] == "inc1" and c.nodes["b"].unresponsive
        else:
            assert not c.nodes["b"].unresponsive


@pytest.mark.slow  # builds the wheel
def test_prices_ship_in_the_built_wheel(tmp_path: Path) -> None:
    """docs/design.md: 'Prices ship with the package (spotctl/data/...)'. Build the wheel
    as users get it, unpack it away from the checkout, and price offers from it alone."""
    import subprocess
    import sys
    import zipfile

    from spotctl.remote.package import spotctl_wheel

    wheel = spotctl_wheel(tmp_path / "cache")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        z.extractall(tmp_path / "site")
    for f in ("aws_gpu_catalog.csv", "aws_spot_advisor.json", "gcp_gpu_catalog.csv",
              "AWS_SOURCES.md", "GCP_SOURCES.md"):  # fmt: skip
        assert f"spotctl/data/{f}" in names, f
    code = (
        "import spotctl, json\n"
        "from spotctl.providers.aws import catalog as a\n"
        "from spotctl.providers.gcp import catalog as g\n"
        "aws = a.load_offers()\n"
        "print(json.dumps([spotctl.__file__, len(aws), sum(o.spot_price > 0 for o in aws),"
        " len(g.catalog())]))\n"
    )
    p = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(tmp_path / 'site')!r})\n" + code],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stderr
    where, n_aws, priced, n_gcp = __import__("json").loads(p.stdout)
    assert where.startswith(str(tmp_path / "site")), where  # the wheel's copy, not the checkout
    assert n_aws > 10 and priced == n_aws and n_gcp > 10, (n_aws, priced, n_gcp)


def test_documented_exit_codes_are_the_error_classes_codes() -> None:
    from spotctl import errors

    m = re.search(r"an exit code that says its kind:(.*?)\.\n", OPERATING, re.S)
    assert m, "docs/operating.md: the exit-code sentence is gone"
    listed = {int(code): what for code, what in re.findall(r"(\d) ([^,]+)", m.group(1))}
    classes = [c for c in vars(errors).values()
               if isinstance(c, type) and issubclass(c, errors.SpotctlError)]
    assert set(listed) == {c.exit_code for c in classes}, (listed, classes)
    expect = {errors.SpotctlError: "other", errors.SpecError: "bad spec",
              errors.NotFoundError: "no such cluster", errors.StateError: "locked local state",
              errors.ProviderError: "a provider's API", errors.QuotaError: "quota",
              errors.AuthError: "credentials", errors.BootstrapError: "bootstrapped"}
    for cls, words in expect.items():
        assert words in " ".join(listed[cls.exit_code].split()), (cls, listed)
