"""A real local cluster driven through the real CLI (subprocesses), torchrun and gloo.

The harness lives in tests/conftest.py (`LocalCluster`, the `local_cluster` fixture); these
names stay importable from here for tests that import them."""

from tests.conftest import REPO, SPOTCTL, LocalCluster, local_cluster  # noqa: F401
