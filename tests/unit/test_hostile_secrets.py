"""Issue 25, secrets: credentials in any URL form never reach a message steadytrain prints.

``redact_text`` is fuzzed over many URL shapes and the text around them; a storage URL that
carries credentials is refused (by ``Store`` and, before any work, by the CLI) with a message
naming the URL masked and where credentials go; the CLI's streams, its traceback for a bug
and log records are masked too. The real-server check is tests/s3/test_hostile_secrets_s3.py.
"""

from __future__ import annotations

import io
import logging
import os
import string
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from steadytrain import cli
from steadytrain.errors import StorageError
from steadytrain.redact import (
    REDACTED,
    RedactingLogFilter,
    RedactingStream,
    known_secrets,
    redact_text,
    register_secrets,
    url_credentials,
    url_credentials_message,
    url_without_credentials,
)
from steadytrain.storage.store import Store
from steadytrain.testing import forkserver

MARK = "SEKRIT"  # planted in every generated secret; the surrounding text cannot spell it

# Characters a secret may hold in each shape (docs: redact.py's module docstring).
USERINFO_CHARS = string.ascii_letters + string.digits + "-._~%!$&()*+,;=:/"
TOKEN_CHARS = string.ascii_letters + string.digits + "-._~%!$&()*+,;="  # token@: no ":" "/"
QUERY_CHARS = string.ascii_letters + string.digits + "-._~%+/="
ASSIGN_CHARS = string.ascii_letters + string.digits + "-._~%+/=:!$*"
USER_CHARS = string.ascii_letters + string.digits + "-._~%"
HOST_CHARS = string.ascii_lowercase + string.digits + "-."
# Text around a secret: anything printable but the marker's letters ("K" and "I" missing).
AROUND_CHARS = "".join(c for c in string.printable if c not in "KIki\x0b\x0c")

QUERY_NAMES = [
    "X-Amz-Signature",
    "X-Amz-Credential",
    "X-Amz-Security-Token",
    "Signature",
    "sig",
    "aws_secret_access_key",
    "AWSAccessKeyId",
    "access_token",
    "token",
    "password",
]
ASSIGN_NAMES = ["password", "secret", "aws_secret_access_key", "client_secret", "session_token"]


def _secret(chars: str) -> st.SearchStrategy[str]:
    piece = st.text(alphabet=chars, max_size=12)
    return st.builds(lambda a, b: f"{a}{MARK}{b}", piece, piece)


_scheme = st.sampled_from(["s3", "s3a", "gs", "http", "https", "file", "sftp", "az", "hdfs"])
_host = st.text(alphabet=HOST_CHARS, min_size=1, max_size=15).map(lambda h: "h" + h)
_path = st.text(alphabet=string.ascii_letters + string.digits + "/-_.@", max_size=20)
_port = st.integers(min_value=1, max_value=65535).map(lambda p: f":{p}")


@st.composite
def secret_in_shape(draw: st.DrawFn) -> tuple[str, bool]:
    """(text holding one secret in one shape, whether the shape may be glued to words)."""
    shape = draw(st.integers(min_value=0, max_value=7))
    user = draw(st.text(alphabet=USER_CHARS, max_size=10))
    host, path = draw(_host), "/" + draw(_path)
    if shape == 0:  # scheme://user:secret@host/path (the secret may hold a raw "/")
        return f"{draw(_scheme)}://{user}:{draw(_secret(USERINFO_CHARS))}@{host}{path}", True
    if shape == 1:  # scheme://token@host/path
        return f"{draw(_scheme)}://{draw(_secret(TOKEN_CHARS))}@{host}{path}", True
    if shape == 2:  # with a port and a query after it
        port = draw(_port)
        return f"https://{user}:{draw(_secret(USERINFO_CHARS))}@{host}{port}{path}?p=1", True
    if shape == 3:  # a presigned URL or a credential in a query
        name = draw(st.sampled_from(QUERY_NAMES))
        sep = draw(st.sampled_from(["?", "?a=1&", "?a=1;"]))
        return f"https://{host}{path}{sep}{name}={draw(_secret(QUERY_CHARS))}&part=2", True
    if shape == 4:  # botocore's "Invalid bucket name" quoting KEY:SECRET@bucket
        q = draw(st.sampled_from(['"', "'", " "]))
        return f"{q}{user or 'AKIA'}:{draw(_secret(USERINFO_CHARS))}@{host}{q}", False
    if shape == 5:  # name=value
        name = draw(st.sampled_from(ASSIGN_NAMES))
        return f"{name}={draw(_secret(ASSIGN_CHARS))}", False
    if shape == 6:  # a dict repr quoting storage options
        name, q = draw(st.sampled_from(ASSIGN_NAMES)), draw(st.sampled_from(["'", '"']))
        return f"{{{q}{name}{q}: {q}{draw(_secret(ASSIGN_CHARS))}{q}}}", False
    kind = draw(st.sampled_from(["Bearer ", "Basic ", ""]))
    sep = draw(st.sampled_from([": ", "=", " = ", "': '"]))
    return f"Authorization{sep}{kind}{draw(_secret(ASSIGN_CHARS))}", False


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shaped=secret_in_shape(),
    before=st.text(alphabet=AROUND_CHARS, max_size=40),
    after=st.text(alphabet=AROUND_CHARS, max_size=40),
    glue=st.sampled_from([" ", "\n", "'", '"', "(", ": ", "=", "\t"]),
    glued=st.booleans(),
)
def test_redact_text_removes_a_secret_from_any_url_shape(
    shaped: tuple[str, bool], before: str, after: str, glue: str, glued: bool
) -> None:
    body, may_glue = shaped
    left = "" if (glued and may_glue) else glue
    right = "" if (glued and may_glue) else " "
    text = f"{before}{left}{body}{right}{after}"
    out = redact_text(text)
    assert MARK not in out, (text, out)
    assert REDACTED in out
    assert redact_text(out) == out  # idempotent: a masked message stays as it is


def test_redact_text_keeps_what_to_check_visible() -> None:
    """The URL stays readable around the mask: the bucket, the host, the path, other
    parameters, and ordinary ``key=...`` / ``"eos_token": ...`` text are left alone."""
    cases = {
        "s3://AKIA:wJal/K7MD/bPx@bucket/ds/x": f"s3://{REDACTED}@bucket/ds/x",
        'Invalid bucket name "AKIA:SECRETXYZ@steady": must match': (
            f'Invalid bucket name "{REDACTED}@steady": must match'
        ),
        "https://h/x?X-Amz-Credential=AK%2F1&X-Amz-Signature=abc123&part=2": (
            f"https://h/x?X-Amz-Credential={REDACTED}&X-Amz-Signature={REDACTED}&part=2"
        ),
        "{'key': 'AKIA1', 'secret': 'shh-1234', 'eos_token': '<eos>'}": (
            f"{{'key': 'AKIA1', 'secret': '{REDACTED}', 'eos_token': '<eos>'}}"
        ),
        "pass storage_options={'key': ..., 'secret': ...}": (
            "pass storage_options={'key': ..., 'secret': ...}"
        ),
        "s3://bucket/user@example.com/data": "s3://bucket/user@example.com/data",
        "http://127.0.0.1:9000/b": "http://127.0.0.1:9000/b",
        "sort key=3, tokens=12, num_tokens: 5": "sort key=3, tokens=12, num_tokens: 5",
    }
    for text, want in cases.items():
        assert redact_text(text) == want


@pytest.mark.parametrize(
    ("url", "secret", "clean"),
    [
        ("s3://AKIAPLANT:PLANTED-SECRET-1@steady/x", "PLANTED-SECRET-1", "s3://steady/x"),
        ("s3://AKIAPLANT:PLANTED/SEC/RET-2@steady/x", "PLANTED/SEC/RET-2", "s3://steady/x"),
        ("s3a://PLANTED-TOKEN-3@steady/x", "PLANTED-TOKEN-3", "s3a://steady/x"),
        ("gs://PLANTED-TOKEN-4@bkt/x", "PLANTED-TOKEN-4", "gs://bkt/x"),
        ("https://u:PLANTED-PW-5@host:8443/ds", "PLANTED-PW-5", "https://host:8443/ds"),
        ("file://u:PLANTED-PW-6@host/ds", "PLANTED-PW-6", "file://host/ds"),
        (
            "s3://steady/x?aws_secret_access_key=PLANTED-Q-7&versionId=3",
            "PLANTED-Q-7",
            "s3://steady/x?versionId=3",
        ),
        (
            "https://b.s3.amazonaws.com/x?X-Amz-Signature=PLANTED-SIG-8",
            "PLANTED-SIG-8",
            "https://b.s3.amazonaws.com/x",
        ),
    ],
)
def test_a_url_with_credentials_is_refused_naming_it_masked_and_the_fix(
    url: str, secret: str, clean: str
) -> None:
    assert secret in url_credentials(url)
    assert url_without_credentials(url) == clean
    with pytest.raises(StorageError) as info:
        Store(url)  # refused before any client is built: no network needed
    msg = str(info.value)
    assert secret not in msg and REDACTED in msg
    assert "credentials in a URL are refused" in msg and f"use {clean} and " in msg
    if url.startswith("s3"):
        assert "AWS_ACCESS_KEY_ID" in msg and "AWS_PROFILE" in msg
    assert secret in known_secrets()  # from now on masked in any text of this process
    assert redact_text(f"a library says {secret}!") == f"a library says {REDACTED}!"


@pytest.mark.parametrize(
    "url",
    [
        "s3://bucket/user@example.com/data",
        "sftp://user@host/data",  # a user name is not a secret
        "abfs://container@account.dfs.core.windows.net/ds",
        "http://127.0.0.1:9000/b/a@c",
        "http://[::1]/a@b",
        "/tmp/a:b@c/ds",  # a local directory may be named so
        "s3://bucket/x?versionId=3",
    ],
)
def test_urls_without_credentials_are_not_refused(url: str) -> None:
    assert url_credentials(url) == [] and url_credentials_message(url) is None


def test_a_store_masks_its_secret_options_in_any_later_text(tmp_path) -> None:
    opts = {"key": "AKIA-ID-NOT-SECRET", "secret": "PLANTED-OPT-SECRET-9"}
    Store(str(tmp_path), opts)
    assert "PLANTED-OPT-SECRET-9" in known_secrets()
    assert "AKIA-ID-NOT-SECRET" not in known_secrets()  # an identity, shown in advice
    assert "PLANTED-OPT-SECRET-9" not in redact_text("boto: bad sig PLANTED-OPT-SECRET-9")


def test_register_secrets_ignores_short_and_non_strings() -> None:
    register_secrets(["pass", None, 12345678, "PLANTED-REG-10"])
    assert "pass" not in known_secrets() and "PLANTED-REG-10" in known_secrets()
    assert redact_text("pass it on") == "pass it on"


COMMANDS = [
    ["inspect", "{url}"],
    ["verify", "{url}"],
    ["tokenize", "{readme}", "--out", "{url}"],
    ["checkpoints", "{url}"],
    ["stage", "{url}", "--cache", "{cache}"],
    ["shuffle", "{url}", "--out", "{cache}/o", "--seq-len", "8"],
]


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: a[0])
def test_cli_refuses_a_location_with_credentials_exit_2(argv, tmp_path, capsys) -> None:
    secret = f"PLANTED-CLI-{argv[0]}"
    url = f"s3://AKIAPLANT:{secret}/x+y@steady/ds"
    readme = tmp_path / "in.txt"
    readme.write_text("hello\n")
    args = [a.format(url=url, readme=readme, cache=tmp_path / "c") for a in argv]
    rc = cli.main(args)
    out, err = capsys.readouterr()
    assert rc == 2, err
    assert secret not in out + err and "AKIAPLANT" not in out + err
    assert f"s3://{REDACTED}@steady/ds: credentials in a URL are refused" in err
    assert "use s3://steady/ds and set AWS_ACCESS_KEY_ID" in err
    assert not (tmp_path / "c").exists()  # refused before any work


def test_cli_masks_a_bugs_traceback(monkeypatch, capsys) -> None:
    """An exception that is not a SteadyError (a bug, or a library's raw error) prints its
    traceback masked, with the exit status Python gives an uncaught exception."""
    import steadytrain.commands.inspect as inspect_cmd

    def boom(_args):
        try:
            raise OSError("endpoint http://bob:PLANTED-TB-11@127.0.0.1:1 refused")
        except OSError as exc:
            raise RuntimeError(
                'Invalid bucket name "AKIA:PLANTED-TB-12@steady" (X-Amz-Signature=PLANTED-TB-13)'
                " at https://h/x?X-Amz-Signature=PLANTED-TB-13"
            ) from exc

    monkeypatch.setattr(inspect_cmd, "run", boom)
    assert cli.main(["inspect", "somewhere"]) == 1
    out, err = capsys.readouterr()
    assert "Traceback (most recent call last)" in err and "RuntimeError" in err
    assert "OSError" in err  # the chained cause is shown too
    for planted in ("PLANTED-TB-11", "PLANTED-TB-12", "PLANTED-TB-13"):
        assert planted not in out + err
    assert f"http://{REDACTED}@127.0.0.1:1" in err


def test_cli_masks_secrets_from_the_environment_and_log_records(
    monkeypatch, capsys, caplog
) -> None:
    """A library that logs (root's handlers: botocore's records) or prints a secret the
    process holds in the environment, in a shape nobody foresaw: masked."""
    import steadytrain.commands.inspect as inspect_cmd

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "PLANTED-ENV-14-xyz")

    def chatty(_args):
        print("signing with PLANTED-ENV-14-xyz now")
        logging.getLogger("botocore.auth").warning("auth http://u:PLANTED-LOG-15@h failed")
        logging.getLogger("steadytrain.storage").warning("key AKIA:PLANTED-LOG-16@b")
        return 0

    monkeypatch.setattr(inspect_cmd, "run", chatty)
    with caplog.at_level(logging.WARNING):
        assert cli.main(["inspect", "somewhere"]) == 0
    out, err = capsys.readouterr()
    assert out == f"signing with {REDACTED} now\n"
    messages = [r.getMessage() for r in caplog.records]
    assert f"auth http://{REDACTED}@h failed" in messages
    assert f"key {REDACTED}@b" in messages
    assert "PLANTED" not in caplog.text + out + err


def test_steadytrain_log_records_are_masked_and_still_printed_without_handlers() -> None:
    """With no logging configured (a plain script), Python's last-resort handler still
    prints a steadytrain warning, masked; nothing below WARNING appears."""
    code = (
        "import logging, steadytrain.errors\n"
        "logging.getLogger('steadytrain.monitor').warning('at s3://u:PLANTED-LR-17@b/x')\n"
        "logging.getLogger('steadytrain.monitor').info('quiet PLANTED-LR-18')\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert res.stderr == f"at s3://{REDACTED}@b/x\n"


def test_redacting_stream_masks_a_url_written_in_pieces_and_delegates() -> None:
    target = io.StringIO()
    stream = RedactingStream(target)
    stream.write("s3://AKIA:PLANTED-")
    stream.write("ST-19@b/x and more")
    assert target.getvalue() == ""  # held until the line ends
    stream.write(" done\nprogress 10%\r")
    assert target.getvalue() == f"s3://{REDACTED}@b/x and more done\nprogress 10%\r"
    stream.write("tail http://u:PLANTED-ST-20@h")
    stream.flush()
    assert target.getvalue().endswith(f"tail http://{REDACTED}@h")
    assert stream.getvalue() == target.getvalue()  # everything else is the target's


def test_log_filter_masks_arguments_and_exception_text() -> None:
    try:
        raise ValueError("bad http://u:PLANTED-LF-21@h")
    except ValueError:
        record = logging.LogRecord(
            "x", logging.ERROR, __file__, 1, "open %s", ("s3://k:PLANTED-LF-22@b",), sys.exc_info()
        )
    assert RedactingLogFilter().filter(record)
    text = logging.Formatter().format(record)
    assert "PLANTED" not in text and "ValueError" in text and f"s3://{REDACTED}@b" in text


def test_train_refuses_a_dataset_url_with_credentials(tmp_path) -> None:
    """``--set data.dataset=...`` reaches the library's ``Store``, which refuses it too."""
    # Forked from the fork server: `train` imports torch, paid once per test process.
    res = forkserver.run(
        [sys.executable, "-m", "steadytrain.cli", "train", "demo",
         "--set", "data.dataset=s3://AKIAPLANT:PLANTED-TR-23@steady/ds",
         "--set", f"run_dir={tmp_path / 'run'}", "--set", 'monitor.sinks=["jsonl"]'],
        timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    assert res.returncode == 2, res.stderr[-2000:]
    assert "PLANTED-TR-23" not in res.stdout + res.stderr
    assert "credentials in a URL are refused" in res.stderr
    for root, _dirs, files in os.walk(tmp_path):  # nothing the run wrote holds it either
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                assert b"PLANTED-TR-23" not in f.read(), name
