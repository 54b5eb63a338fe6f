"""A local cluster whose checkpoints live in S3 (moto server on loopback, reached by the
workers through s3fs and AWS_ENDPOINT_URL): a notice and a join each lose no step, the
drain checkpoints are committed objects in the bucket, and nothing is written locally."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]


def _rescale_after(c, action, reason):
    from tests.conftest import wait_until

    n0 = len(c.events("rescale"))
    action()
    return wait_until(lambda: next((e for e in c.events("rescale")[n0:]
                                    if e["reason"] == reason), None),
                      180, f"a {reason} rescale", 0.5, lambda: f"{c.events('rescale')}\n{c.debug()}")


def test_notice_and_join_with_checkpoints_in_s3(local_cluster):
    pytest.importorskip("s3fs")
    from spotctl.elastic.checkpoint import committed_steps, read_commit
    from tests.elastic.s3 import moto_s3

    with moto_s3("ckpts") as aws_env:
        c = local_cluster("s3ck")
        env = {**aws_env, "TRAIN_DATASET_SIZE": "1024", "TRAIN_GLOBAL_BATCH": "16"}
        c.write_spec("2..3", checkpoint_every=10, train_env=env,
                     extra='checkpoint_dir = "s3://ckpts/s3ck"')
        c.cli("up", "--wait", "120")
        c.assert_one_world(c.steps_advance(world=3, by=5, timeout=180))

        r = _rescale_after(c, lambda: c.cli("preempt", "n1", "--name", "s3ck", "--style", "aws"),
                           "notice")
        assert (r["from_world_size"], r["to_world_size"]) == (3, 2)
        assert r["lost_steps"] == 0 and r["checkpoint_step"] == r["resume_step"]
        c.assert_one_world(c.steps_advance(world=2, by=5))

        r2 = _rescale_after(c, lambda: c.cli("up", "--wait", "120"), "join")
        assert (r2["from_world_size"], r2["to_world_size"], r2["lost_steps"]) == (2, 3, 0)
        c.assert_one_world(c.steps_advance(world=3, by=5))
        c.cli("down", "--name", "s3ck", "--yes")

        steps = committed_steps("s3://ckpts/s3ck")
        assert r["checkpoint_step"] in steps or max(steps) > r2["checkpoint_step"], steps
        assert r2["checkpoint_step"] in steps or max(steps) > r2["checkpoint_step"]
        assert read_commit("s3://ckpts/s3ck", steps[0])["step"] == steps[0]
        assert not (c.cluster_dir / "checkpoints").exists() or not any(
            (c.cluster_dir / "checkpoints").iterdir())
