"""Issue 25, secrets, against a real SeaweedFS: the installed ``steadytrain`` CLI given a
storage URL with credentials, for each command that opens one.

Before: botocore's "Invalid bucket name "KEY:SECRET@bucket"" printed the secret. Now the URL
is refused with exit 2 before any request, the message names it masked and says where the
credentials go; following that advice (the same URL without them, the keys in the
environment) works against the same server. An endpoint whose URL holds a password fails
with botocore's own error, masked.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from steadytrain.redact import REDACTED

pytestmark = pytest.mark.s3

EXE = os.path.join(os.path.dirname(sys.executable), "steadytrain")


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ, STEADYTRAIN_STORAGE_RETRY_S="2", STEADYTRAIN_STORAGE_TIMEOUT_S="5")
    full.update(env)
    return subprocess.run([EXE, *args], capture_output=True, text=True, timeout=180, env=full)


@pytest.fixture(scope="module")
def dataset(s3_server, tmp_path_factory):
    """A real dataset under a prefix of its own, written by the CLI with the credentials
    where the refusal says they go (the environment): the advice works. Built once for the
    module: every test only reads it (each command is refused before any request, and the
    one that would write names another prefix)."""
    text = tmp_path_factory.mktemp("secrets-dataset") / "in.txt"
    text.write_text("hello world\n" * 200)
    url = f"s3://steady/t-{uuid.uuid4().hex[:10]}"
    res = _cli(["tokenize", str(text), "--out", url], s3_server.env())
    assert res.returncode == 0, res.stderr[-2000:]
    return url


def _commands(url: str, tmp) -> dict[str, list[str]]:
    src = tmp / "in.txt"
    if not src.exists():
        src.write_text("hello\n")
    return {
        "inspect": ["inspect", url],
        "verify": ["verify", url],
        "tokenize": ["tokenize", str(src), "--out", url + "-new"],
        "checkpoints": ["checkpoints", url],
        "stage": ["stage", url, "--cache", str(tmp / "cache")],
    }


@pytest.mark.parametrize(
    "shape",
    [
        "s3://{key}:{secret}@{rest}",  # the row, with the server's real keys
        "s3://{key}:PLANTED/SEC+RET-1@{rest}",  # an AWS-style secret with a raw "/"
        "s3://PLANTED-TOKEN-2@{rest}",
        "s3://{rest}?aws_secret_access_key=PLANTED-Q-3",
    ],
)
def test_every_command_refuses_credentials_in_the_url(s3_server, dataset, tmp_path, shape) -> None:
    bucket_and_prefix = dataset.split("://", 1)[1]
    url = shape.format(key=s3_server.access_key, secret=s3_server.secret_key, rest=dataset[5:])
    secrets = [s3_server.secret_key, "PLANTED"]
    for name, args in _commands(url, tmp_path).items():
        # No credentials in the environment: only the URL holds any, and it is refused.
        env = {"STEADYTRAIN_S3_ENDPOINT": s3_server.endpoint}
        res = _cli(args, env)
        text = res.stdout + res.stderr
        assert res.returncode == 2, (name, res.stderr[-2000:])
        for secret in secrets:
            assert secret not in text, (name, text)
        assert "credentials in a URL are refused" in res.stderr, (name, res.stderr)
        assert f"use s3://{bucket_and_prefix}" in res.stderr, (name, res.stderr)
        assert "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in res.stderr
        assert "Traceback" not in text
    assert not (tmp_path / "cache").exists()  # refused before any work
    # The advice, followed: the clean URL with the keys in the environment works.
    ok = _cli(["inspect", dataset, "--json"], s3_server.env())
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert '"num_tokens"' in ok.stdout


def test_endpoint_password_is_refused_masked(s3_server, dataset, tmp_path) -> None:
    """Credentials in the endpoint (an environment variable) are refused too, at once: each
    request would fail inside aiohttp, which used to read "storage did not answer"."""
    endpoint = s3_server.endpoint.replace("http://", "http://bob:PLANTED-EP-4@")
    env = {**s3_server.env(), "STEADYTRAIN_S3_ENDPOINT": endpoint}
    for name, args in _commands(dataset, tmp_path).items():
        res = _cli(args, env)
        text = res.stdout + res.stderr
        assert res.returncode == (1 if name == "verify" else 2), (name, res.stderr[-2000:])
        assert "PLANTED-EP-4" not in text and "bob" not in text
        assert f"the endpoint http://{REDACTED}@127.0.0.1" in res.stderr, (name, res.stderr)
        assert "(from STEADYTRAIN_S3_ENDPOINT)" in res.stderr
        assert f"use {s3_server.endpoint} and set AWS_ACCESS_KEY_ID" in res.stderr
        assert "did not answer" not in res.stderr and "Traceback" not in text
