"""The fault matrix of issue 9: scenarios run on a real local cluster (and, for cloud API
faults, against the AWS/GCP test servers); `scripts/chaos` prints the table, tests/faults
asserts on the same rows."""
