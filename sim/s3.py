"""A real S3 server for tests: moto's server over TLS on loopback, with credentials enforced.

moto answers S3 and IAM from memory. It is run as a separate process (`python -m
sim.s3`), so its request threads never compete with the test's trio loop and a test
may stop it to see what an unreachable endpoint does. The process binds port 0 itself and
prints the port it got, so no port is guessed.

The set-up: the server starts with `INITIAL_NO_AUTH_ACTION_COUNT=inf`
(every request allowed), an admin and one user per workspace are created with access keys
and identity policies that allow only their own bucket, and then `POST /moto-api/reset-auth`
turns enforcement on: from then on a request is checked against the caller's SigV4 signature
and IAM policies.

moto's WSGI app is served by cheroot, not by werkzeug's development server, which closes every
connection after one request and first waits 10 ms for the client to hang up: 16 ms per small
request over TLS, against 3 ms on cheroot's keep-alive connections (a listing, a HEAD, a file
of a thousand small ones). Bodies reach cheroot in 1 MiB pieces: handed a large one whole, its
buffered writer moves the unsent rest after every partial send, and a 64 MiB GET ran at
490 MB/s instead of 755.

TLS: a trustme CA per server issues the certificate for 127.0.0.1 and localhost; clients are
pointed at the CA file (`ca_file`), which is not a secret.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import ssl
import subprocess
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import boto3
import trustme
from botocore.config import Config

from sim.registry import stop_process
from workerapi.models import S3Credentials

REGION = "us-east-1"
PIECE_BYTES = 1 << 20


@attrs.frozen
class S3User:
    """An IAM user with one access key; `bucket` is the only bucket its policy allows."""

    name: str
    bucket: str
    access_key_id: str = attrs.field(repr=False)
    secret_access_key: str = attrs.field(repr=False)


@attrs.define
class S3Server:
    """A running moto server; `stop` ends the process (the endpoint then refuses)."""

    endpoint: str
    """`https://127.0.0.1:PORT`"""
    ca_file: Path
    process: subprocess.Popen[bytes]
    directory: Path
    admin: S3User
    """Allowed everything (IAM and every bucket): for set-up and for breaking things in tests."""
    users: dict[str, S3User] = attrs.field(factory=dict)

    @property
    def port(self) -> int:
        return int(self.endpoint.rsplit(":", 1)[1])

    def client(self, service: str = "s3", user: S3User | None = None) -> Any:
        """A boto3 client for `service` signed with `user`'s keys (the admin's by default)."""
        who = user or self.admin
        return boto3.client(
            service,
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id=who.access_key_id,
            aws_secret_access_key=who.secret_access_key,
            verify=str(self.ca_file),
            config=Config(
                s3={"addressing_style": "path"},
                retries={"max_attempts": 2, "mode": "standard"},
            ),
        )

    def add_workspace(self, workspace: str) -> S3User:
        """A new bucket `bucket-<workspace>` and a user allowed only that bucket (works with
        auth on: it is done as the admin)."""
        bucket = f"bucket-{workspace}"
        self.client("s3").create_bucket(Bucket=bucket)
        user = _make_user(self.client("iam"), f"user-{workspace}", bucket)
        self.users[workspace] = user
        return user

    def revoke(self, user: S3User) -> None:
        """Take `user`'s bucket policy away: from now on it may do nothing."""
        self.client("iam").delete_user_policy(
            UserName=user.name, PolicyName=bucket_policy_name(user.bucket)
        )

    def log(self) -> str:
        try:
            return (self.directory / "moto.log").read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        stop_process(self.process)


def _bucket_policy_document(bucket: str) -> str:
    return json.dumps(
        {
            "Version": "2012-10-17",
            "Statement": [
                {
                    "Effect": "Allow",
                    "Action": "s3:*",
                    "Resource": [f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"],
                }
            ],
        }
    )


def s3_credentials(server: S3Server, user: S3User, **changes: str) -> S3Credentials:
    """`user`'s keys for `server`'s endpoint; `changes` replace fields (a wrong secret...)."""
    credentials = S3Credentials(
        access_key_id=user.access_key_id,
        secret_access_key=user.secret_access_key,
        endpoint=server.endpoint,
    )
    return attrs.evolve(credentials, **changes)


def bucket_policy_name(bucket: str) -> str:
    return f"only-{bucket}"


def _make_user(iam: Any, name: str, bucket: str, policy: str | None = None) -> S3User:
    iam.create_user(UserName=name)
    iam.put_user_policy(
        UserName=name,
        PolicyName=bucket_policy_name(bucket) if policy is None else "admin",
        PolicyDocument=policy or _bucket_policy_document(bucket),
    )
    key = iam.create_access_key(UserName=name)["AccessKey"]
    return S3User(name, bucket, key["AccessKeyId"], key["SecretAccessKey"])


def _admin_policy() -> str:
    return json.dumps(
        {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}],
        }
    )


def _wait_for_port(process: subprocess.Popen[bytes], ready_s: float) -> int:
    """Read the `PORT n` line the server prints once it listens."""
    import selectors

    assert process.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(ready_s):
            raise RuntimeError(f"moto did not report a port within {ready_s} s")
    line = process.stdout.readline().decode(errors="replace").strip()
    if not line.startswith("PORT "):
        raise RuntimeError(f"moto did not start (said {line!r}); see its log")
    return int(line.split()[1])


def _set_up(server: S3Server, workspaces: Sequence[str]) -> None:
    import httpx

    # Before auth is on, any well-formed keys are accepted: use throwaway ones to create the
    # admin, then everything else as the admin.
    bootstrap = boto3.client(
        "iam",
        endpoint_url=server.endpoint,
        region_name=REGION,
        aws_access_key_id="AKIABOOTSTRAPBOOTSTR",
        aws_secret_access_key="bootstrap",
        verify=str(server.ca_file),
    )
    server.admin = _make_user(bootstrap, "admin", "*", _admin_policy())
    for workspace in workspaces:
        server.add_workspace(workspace)
    response = httpx.post(
        f"{server.endpoint}/moto-api/reset-auth",
        content=b"0",
        headers={"Content-Type": "text/plain"},
        verify=ssl.create_default_context(cafile=str(server.ca_file)),
    )
    response.raise_for_status()


def start_s3_server(
    directory: Path, workspaces: Sequence[str] = ("a", "b"), *, ready_s: float = 30.0
) -> S3Server:
    """Start moto over TLS under `directory`, create a user and a bucket per workspace
    (`bucket-<workspace>`, user `user-<workspace>`, allowed only that bucket), then turn
    auth on. The caller must `stop()` it (`running_s3_server` does)."""
    directory.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    ca_file = directory / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    cert_file, key_file = directory / "server.pem", directory / "server.key"
    cert.cert_chain_pems[0].write_to_path(str(cert_file))
    for extra in cert.cert_chain_pems[1:]:
        extra.write_to_path(str(cert_file), append=True)
    cert.private_key_pem.write_to_path(str(key_file))
    environment = {key: value for key, value in os.environ.items() if not key.startswith("AWS_")}
    environment["INITIAL_NO_AUTH_ACTION_COUNT"] = "inf"
    with (directory / "moto.log").open("ab") as log_file:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sim.s3",
                "--cert",
                str(cert_file),
                "--key",
                str(key_file),
            ],
            stdout=subprocess.PIPE,
            stderr=log_file,
            stdin=subprocess.DEVNULL,
            env=environment,
            cwd=Path(__file__).resolve().parent.parent,
        )
    placeholder = S3User("admin", "*", "", "")
    server = S3Server("", ca_file, process, directory, placeholder)
    try:
        port = _wait_for_port(process, ready_s)
        server.endpoint = f"https://127.0.0.1:{port}"
        _set_up(server, workspaces)
    except BaseException:
        server.stop()
        raise
    return server


@contextlib.contextmanager
def running_s3_server(
    directory: Path, workspaces: Sequence[str] = ("a", "b")
) -> Iterator[S3Server]:
    server = start_s3_server(directory, workspaces)
    try:
        yield server
    finally:
        server.stop()


def _serve(argv: Sequence[str] | None = None) -> None:
    """The server process: moto's WSGI app under cheroot on 127.0.0.1, port 0, TLS, threaded."""
    parser = argparse.ArgumentParser(prog="python -m sim.s3")
    parser.add_argument("--cert", required=True)
    parser.add_argument("--key", required=True)
    args = parser.parse_args(argv)
    from cheroot.ssl.builtin import BuiltinSSLAdapter
    from cheroot.wsgi import Server
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app

    moto_app = DomainDispatcherApplication(create_backend_app)

    def pieces(body: Iterable[bytes]) -> Iterator[bytes]:
        try:
            for part in body:
                for start in range(0, len(part), PIECE_BYTES):
                    yield part[start : start + PIECE_BYTES]
        finally:
            if hasattr(body, "close"):
                body.close()

    def app(environ: Any, start_response: Any) -> Iterator[bytes]:
        return pieces(moto_app(environ, start_response))

    server = Server(("127.0.0.1", 0), app, numthreads=16)
    server.ssl_adapter = BuiltinSSLAdapter(args.cert, args.key)
    server.prepare()
    port = server.bind_addr[1]
    # moto builds some URLs from MOTO_PORT.
    os.environ["MOTO_PORT"] = str(port)
    sys.stdout.write(f"PORT {port}\n")
    sys.stdout.flush()
    server.serve()


if __name__ == "__main__":
    _serve()
