"""A real S3 API on loopback (moto server) for checkpoint tests: s3fs reaches it through
AWS_ENDPOINT_URL, as it would reach a real bucket's endpoint."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

_KEYS = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
         "AWS_EC2_METADATA_DISABLED", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")


@contextmanager
def moto_s3(bucket: str = "ckpts") -> Iterator[dict[str, str]]:
    """Start moto's server, create `bucket`, and set the environment (this process and the
    children it starts) to talk to it. Yields that environment."""
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": "/nonexistent/aws-config",
           "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/aws-credentials"}
    saved = {k: os.environ.get(k) for k in _KEYS}
    os.environ.update(env)
    try:
        boto3.client("s3").create_bucket(Bucket=bucket)
        yield env
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
