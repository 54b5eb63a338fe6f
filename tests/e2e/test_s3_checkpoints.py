"""A local cluster whose checkpoints live in S3 (moto server on loopback, reached by the
workers through s3fs and AWS_ENDPOINT_URL): a notice and a join each lose no step, the
checkpoints are committed objects in the bucket, and nothing is written locally. On
torchrun the drains checkpoint to the bucket; on torchft (issue 17) nothing drains, and
the bucket gets the periodic checkpoints, the copy for when every replica dies. On torchrun
saves run in checkpoint processes, as on CUDA by default."""

from __future__ import annotations

import pytest

from tests.conftest import ENGINES

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]
EVERY = 10


@pytest.mark.parametrize("engine", ENGINES)
def test_notice_and_join_with_checkpoints_in_s3(local_cluster, engine):
    pytest.importorskip("s3fs")
    from spotctl.elastic.checkpoint import committed_steps, read_commit
    from tests.elastic.s3 import moto_s3

    with moto_s3("ckpts") as aws_env:
        c = local_cluster("s3ck")
        # torchrun: saves in checkpoint processes (the CUDA default), which every restart
        # of the workers starts again, through the drains beside them; torchft in threads
        # (its process mode is gpu-check's; a spawn costs this CI seconds of CPU)
        mode = "process" if engine == "torchrun" else "thread"
        env = {**aws_env, "TRAIN_DATASET_SIZE": "1024", "TRAIN_GLOBAL_BATCH": "16",
               "SPOTCTL_ASYNC_SAVE": mode}
        c.write_spec("2..3", checkpoint_every=EVERY, train_env=env,
                     extra='checkpoint_dir = "s3://ckpts/s3ck"', engine=engine)
        c.cli("up", "--wait", "120")
        c.assert_one_world(c.steps_advance(world=3, by=5, timeout=180))

        # lost steps by the workers' own sample traces: no step trained twice (the head's
        # lost_steps beside it, from its throttled reports)
        r, w = c.replays_of(
            lambda: c.cli("preempt", "n1", "--name", "s3ck", "--style", "aws"), "notice")
        assert (r["from_world_size"], r["to_world_size"]) == (3, 2)
        assert w["replayed"] == 0 and r["lost_steps"] == 0, (w, r)
        c.assert_one_world(c.steps_advance(world=2, by=5))

        r2, w2 = c.replays_of(lambda: c.cli("up", "--wait", "120"), "join")
        assert (r2["from_world_size"], r2["to_world_size"], r2["lost_steps"]) == (2, 3, 0)
        assert w2["replayed"] == 0, w2
        st = c.steps_advance(world=3, by=EVERY + 1)
        c.assert_one_world(st)
        c.cli("down", "--name", "s3ck", "--yes")
        # the periodic saves ran in checkpoint processes (the default on CUDA), which met
        # over spotctl's store (DCP's prefix store on it; its own way logs no prefix store)
        logs = "".join(p.read_text(errors="replace") for p in c.cluster_dir.glob("nodes/*/*.log"))
        met = "checkpoint background process with prefix store" in logs
        assert met == (mode == "process"), c.debug()[-3000:]

        steps = committed_steps("s3://ckpts/s3ck")
        assert steps and read_commit("s3://ckpts/s3ck", steps[0])["step"] == steps[0]
        assert steps[0] >= st["last_checkpoint_step"] > 0, (steps, st["last_checkpoint_step"])
        if engine == "torchrun":  # the drains' checkpoints, or newer ones kept instead
            # (pruned oldest first: a drain's step missing means every kept one is newer)
            assert r["checkpoint_step"] in steps or min(steps) > r["checkpoint_step"], steps
            assert r2["checkpoint_step"] in steps or min(steps) > r2["checkpoint_step"], steps
        # (torchft writes no drain checkpoint: its steps are the periodic saves', at
        # multiples of EVERY or, put off while the one before still uploaded, later)
        assert not (c.cluster_dir / "checkpoints").exists() or not any(
            (c.cluster_dir / "checkpoints").iterdir())
