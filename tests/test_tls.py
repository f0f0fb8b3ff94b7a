"""Tests for wire.tls: the TLS stream, pinning, certificates and contexts."""

from __future__ import annotations

import hashlib
import ipaddress
import os
import random
import ssl
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
import trio.testing
import trustme
from cryptography import x509

from wire.tls import (
    CertKey,
    PinMismatchError,
    TLSStream,
    fingerprint_of_pem,
    make_self_signed,
    normalize_fingerprint,
    pinned_client_context,
    server_context,
    verifying_client_context,
)

CERT = make_self_signed("worker-1", ["127.0.0.1", "worker-1.example"])
IMPOSTOR = make_self_signed("worker-1", ["127.0.0.1", "worker-1.example"])

TransportPair = Callable[[], tuple[trio.abc.Stream, trio.abc.Stream]]


def tls_pair(
    transports: TransportPair = trio.testing.memory_stream_pair,
    *,
    server_cert: CertKey = CERT,
    server_ctx: ssl.SSLContext | None = None,
    expected_fingerprint: str | None = CERT.fingerprint,
) -> tuple[TLSStream, TLSStream]:
    """A (client, server) pair over ``transports``; the client pins ``expected_fingerprint``."""
    client_transport, server_transport = transports()
    client = TLSStream(
        client_transport,
        pinned_client_context(),
        server_side=False,
        expected_fingerprint=expected_fingerprint,
    )
    server = TLSStream(
        server_transport,
        server_ctx if server_ctx is not None else server_context(server_cert),
        server_side=True,
    )
    return client, server


async def handshake_both(client: TLSStream, server: TLSStream) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.do_handshake)
        nursery.start_soon(server.do_handshake)


async def connected_pair() -> tuple[TLSStream, TLSStream]:
    client, server = tls_pair()
    await handshake_both(client, server)
    return client, server


async def clogged_pair() -> tuple[TLSStream, TLSStream]:
    client, server = tls_pair(trio.testing.lockstep_stream_pair)
    await handshake_both(client, server)
    return client, server


async def fresh_pair() -> tuple[TLSStream, TLSStream]:
    return tls_pair()


async def test_generic_stream_contract() -> None:
    await trio.testing.check_two_way_stream(connected_pair, clogged_pair)


async def test_generic_stream_contract_with_implicit_handshake() -> None:
    await trio.testing.check_two_way_stream(fresh_pair, None)


async def test_alpn_negotiates_h2() -> None:
    client, server = await connected_pair()
    assert client.selected_alpn_protocol() == "h2"
    assert server.selected_alpn_protocol() == "h2"
    assert client.peer_fingerprint() == CERT.fingerprint
    assert client.getpeercert() is not None


async def test_receive_returns_many_records_at_once() -> None:
    client, server = await connected_pair()
    payload = random.Random(1).randbytes(1 << 20)
    await client.send_all(payload)

    first = await server.receive_some()
    # One TLS record carries at most 16 KiB; trio.SSLStream would return exactly that.
    assert len(first) > 16 * 1024
    second = await server.receive_some(100_000)
    assert len(second) == 100_000

    got = bytearray(first + second)
    while len(got) < len(payload):
        got += await server.receive_some()
    assert got == payload


@pytest.mark.parametrize(
    "sizes",
    [
        [9, 1 << 20, 3],  # a frame header, a payload, a small frame
        [9, 16 * 1024 - 10, 9, 5],  # small ones around a record's size
        [1, 2, 3],
        [40_000, 9, 9, 9, 3 * (1 << 20) + 7, 100],
    ],
)
async def test_parts_arrive_as_if_joined(sizes: list[int]) -> None:
    client, server = await connected_pair()
    rng = random.Random(sum(sizes))
    parts = [rng.randbytes(size) for size in sizes]
    joined = b"".join(parts)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.send_parts, parts)
            assert await receive_exactly(server, len(joined)) == joined


async def receive_exactly(stream: trio.abc.Stream, size: int) -> bytes:
    got = bytearray()
    while len(got) < size:
        chunk = await stream.receive_some(size - len(got))
        assert chunk, "unexpected EOF"
        got += chunk
    return bytes(got)


@pytest.mark.slow
async def test_loopback_sockets_carry_64_mib_intact() -> None:
    size = 64 * 1024 * 1024
    payload = random.Random(2).randbytes(size)
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]

    async def serve() -> None:
        transport = await listeners[0].accept()
        server = TLSStream(transport, server_context(CERT), server_side=True)
        remaining = int.from_bytes(await receive_exactly(server, 8), "big")
        digest = hashlib.sha256()
        while remaining:
            chunk = await server.receive_some()
            assert chunk, "unexpected EOF"
            digest.update(chunk)
            remaining -= len(chunk)
        await server.send_all(digest.digest())
        assert await server.receive_some() == b""
        await server.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve)
        transport = await trio.open_tcp_stream("127.0.0.1", port)
        client = TLSStream(
            transport,
            pinned_client_context(),
            server_side=False,
            expected_fingerprint=CERT.fingerprint,
        )
        await client.send_all(size.to_bytes(8, "big"))
        view = memoryview(payload)
        step = 3 * 1024 * 1024 + 7
        for start in range(0, size, step):
            await client.send_all(view[start : start + step])
        assert await receive_exactly(client, 32) == hashlib.sha256(payload).digest()
        await client.aclose()
    await listeners[0].aclose()


async def test_pinned_certificate_is_accepted_in_colon_form() -> None:
    colons = ":".join(
        CERT.fingerprint[i : i + 2] for i in range(0, len(CERT.fingerprint), 2)
    ).upper()
    client, server = tls_pair(expected_fingerprint=colons)
    await handshake_both(client, server)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.send_all, b"hello")
        assert await server.receive_some() == b"hello"


async def test_pin_mismatch_fails_both_sides() -> None:
    client, server = tls_pair(server_cert=IMPOSTOR, expected_fingerprint=CERT.fingerprint)

    async def client_side() -> None:
        with pytest.raises(PinMismatchError) as info:
            await client.do_handshake()
        message = str(info.value)
        assert CERT.fingerprint in message
        assert IMPOSTOR.fingerprint in message
        assert "re-register the worker" in message
        assert info.value.expected == CERT.fingerprint
        assert info.value.actual == IMPOSTOR.fingerprint
        # The stream stays unusable.
        with pytest.raises(trio.BrokenResourceError):
            await client.send_all(b"secret")

    async def server_side() -> None:
        # The client never sent its Finished, so the impostor's handshake fails too.
        with pytest.raises(trio.BrokenResourceError):
            await server.do_handshake()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(client_side)
        nursery.start_soon(server_side)
    await client.aclose()
    await server.aclose()


async def test_pin_mismatch_over_tls_1_2_still_fails_the_client() -> None:
    old_server = server_context(IMPOSTOR)
    old_server.maximum_version = ssl.TLSVersion.TLSv1_2
    client, server = tls_pair(server_ctx=old_server, expected_fingerprint=CERT.fingerprint)

    async def server_side() -> None:
        # With TLS 1.2 the client's Finished goes out before it can see the certificate, so
        # the server completes its handshake and then sees the connection end, as a plain EOF.
        assert await server.receive_some() == b""

    async with trio.open_nursery() as nursery:
        nursery.start_soon(server_side)
        with pytest.raises(PinMismatchError):
            await client.do_handshake()


def test_fingerprint_must_be_sha256_hex() -> None:
    with pytest.raises(ValueError, match="64 hex digits"):
        normalize_fingerprint("abcd")
    with pytest.raises(ValueError, match="expected_fingerprint"):
        TLSStream(
            trio.testing.memory_stream_pair()[0],
            pinned_client_context(),
            server_side=False,
            expected_fingerprint="zz" * 32,
        )


async def test_session_tickets_from_other_servers_are_handled() -> None:
    # Our server_context sends none, but a server that does must not upset the client.
    chatty = server_context(CERT)
    chatty.num_tickets = 2
    client, server = tls_pair(server_ctx=chatty)
    await handshake_both(client, server)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.send_all, b"ping")
        assert await client.receive_some() == b"ping"
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.send_all, b"pong")
        assert await server.receive_some() == b"pong"


async def test_transport_eof_without_close_notify_is_eof() -> None:
    client, server = await connected_pair()
    await client.send_all(b"last words")
    await client.transport_stream.aclose()
    assert await server.receive_some() == b"last words"
    assert await server.receive_some() == b""
    assert await server.receive_some() == b""


async def test_garbage_from_the_peer_breaks_the_stream() -> None:
    client, server = await connected_pair()
    await client.transport_stream.send_all(b"\x17\x03\x03\x00\x05nope!")
    with pytest.raises(trio.BrokenResourceError) as info:
        await server.receive_some()
    assert isinstance(info.value.__cause__, ssl.SSLError)


class FailingStream(trio.abc.Stream):
    """A working transport until ``fail`` is set; then every operation raises."""

    def __init__(self, inner: trio.abc.Stream) -> None:
        self.inner = inner
        self.fail = False

    def _check(self) -> None:
        if self.fail:
            raise trio.BrokenResourceError("cable cut")

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self._check()
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        self._check()
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        self._check()
        return await self.inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.inner.aclose()
        self._check()


async def test_aclose_on_a_broken_transport_does_not_raise() -> None:
    left, right = trio.testing.memory_stream_pair()
    flaky = FailingStream(left)
    client, server = tls_pair(lambda: (flaky, right))
    await handshake_both(client, server)
    flaky.fail = True
    with pytest.raises(trio.BrokenResourceError) as info:
        await client.send_all(b"x")
    assert "cable cut" in str(info.value.__cause__)
    await client.aclose()
    await client.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await client.send_all(b"x")
    # The server saw the connection end without close_notify: a plain EOF.
    assert await server.receive_some() == b""
    await server.aclose()


async def test_aclose_on_a_failing_transport_before_the_handshake() -> None:
    left, right = trio.testing.memory_stream_pair()
    flaky = FailingStream(left)
    flaky.fail = True
    client = TLSStream(flaky, pinned_client_context(), server_side=False)
    # The transport's own aclose raises here; ours must not.
    await client.aclose()
    # Nothing to say goodbye to before a handshake: the peer sees a plain EOF, no bytes, and
    # the transport is closed all the same.
    with pytest.raises(trio.ClosedResourceError):
        await left.send_all(b"x")
    with trio.fail_after(5):
        assert await right.receive_some() == b""
    # Our stream is closed, not broken, and closing it again is harmless.
    with pytest.raises(trio.ClosedResourceError):
        await client.send_all(b"x")
    with pytest.raises(trio.ClosedResourceError):
        await client.receive_some()
    await client.aclose()


def test_make_self_signed_names_hosts_in_the_right_san_kind() -> None:
    cert = x509.load_pem_x509_certificate(CERT.cert_pem)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert san.get_values_for_type(x509.DNSName) == ["worker-1.example"]
    assert CERT.fingerprint == fingerprint_of_pem(CERT.cert_pem)
    assert CERT.fingerprint != IMPOSTOR.fingerprint
    assert len(CERT.fingerprint) == 64


def test_cert_key_repr_hides_the_key() -> None:
    assert b"PRIVATE KEY" in CERT.key_pem
    assert "PRIVATE" not in repr(CERT)
    assert "key_pem" not in repr(CERT)


def test_make_self_signed_rejects_bad_input() -> None:
    with pytest.raises(TypeError, match="hosts"):
        make_self_signed("w", "localhost")
    with pytest.raises(ValueError, match="common_name"):
        make_self_signed("", ["localhost"])
    with pytest.raises(ValueError, match="valid_days"):
        make_self_signed("w", ["localhost"], valid_days=0)
    with pytest.raises(ValueError, match="hosts"):
        make_self_signed("w", ["bücher.example"])


def test_server_context_writes_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "cwd"
    temp = tmp_path / "tmp"
    work.mkdir()
    temp.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr("tempfile.tempdir", None)
    fds_before = set(os.listdir("/proc/self/fd"))

    context = server_context(CERT)

    assert list(work.iterdir()) == []
    assert list(temp.iterdir()) == []
    # The in-memory files were closed again.
    assert set(os.listdir("/proc/self/fd")) <= fds_before
    assert context.minimum_version >= ssl.TLSVersion.TLSv1_2


async def test_verifying_client_context_checks_ca_and_host_name() -> None:
    ca = trustme.CA()
    issued = ca.issue_cert("controlplane.example")
    cert_key = CertKey(
        cert_pem=b"".join(pem.bytes() for pem in issued.cert_chain_pems),
        key_pem=issued.private_key_pem.bytes(),
    )
    trusting = verifying_client_context(cadata=ca.cert_pem.bytes().decode())

    async def attempt(
        host: str,
    ) -> tuple[trio.BrokenResourceError | None, trio.BrokenResourceError | None]:
        """Connect to ``host``; return the client's and the server's handshake errors."""
        client_transport, server_transport = trio.testing.memory_stream_pair()
        client = TLSStream(client_transport, trusting, server_side=False, server_hostname=host)
        server = TLSStream(server_transport, server_context(cert_key), server_side=True)
        errors: dict[str, trio.BrokenResourceError] = {}

        async def handshake(name: str, stream: TLSStream) -> None:
            try:
                await stream.do_handshake()
            except trio.BrokenResourceError as exc:
                errors[name] = exc
            else:
                assert stream.selected_alpn_protocol() == "h2"

        async with trio.open_nursery() as nursery:
            nursery.start_soon(handshake, "server", server)
            nursery.start_soon(handshake, "client", client)
        await client.aclose()
        await server.aclose()
        return errors.get("client"), errors.get("server")

    assert await attempt("controlplane.example") == (None, None)
    client_error, server_error = await attempt("elsewhere.example")
    assert client_error is not None
    assert isinstance(client_error.__cause__, ssl.SSLCertVerificationError)
    # The client told the server why, with a TLS alert, rather than just hanging up.
    assert server_error is not None
    assert isinstance(server_error.__cause__, ssl.SSLError)


async def open_post_handshake_auth_pair(
    transports: TransportPair,
) -> tuple[TLSStream, TLSStream]:
    """A handshaken pair where the server may ask for the client's certificate later.

    TLS 1.3 post-handshake authentication makes the client's TLS layer answer a message it
    *reads*, which is how these tests get the reading side to produce bytes to send.
    """
    ca = trustme.CA()
    server_ctx = server_context(CERT)
    server_ctx.verify_mode = ssl.CERT_REQUIRED
    server_ctx.post_handshake_auth = True
    server_ctx.load_verify_locations(cadata=ca.cert_pem.bytes().decode())
    client_ctx = pinned_client_context()
    client_ctx.post_handshake_auth = True
    ca.issue_cert("agent.example").configure_cert(client_ctx)
    client_transport, server_transport = transports()
    client = TLSStream(client_transport, client_ctx, server_side=False)
    server = TLSStream(server_transport, server_ctx, server_side=True)
    await handshake_both(client, server)
    assert server.getpeercert() is None
    return client, server


async def test_bytes_written_while_reading_go_out_without_a_send() -> None:
    client, server = await open_post_handshake_auth_pair(trio.testing.memory_stream_pair)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.receive_some)
            server._ssl.verify_client_post_handshake()  # the only way to provoke it
            await server.send_all(b"who are you?")
            assert await client.receive_some() == b"who are you?"
            await trio.testing.wait_all_tasks_blocked()
            # The client's answer reached the server although the client sent no data.
            assert server.getpeercert() is not None
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    "transports",
    [trio.testing.memory_stream_pair, trio.testing.lockstep_stream_pair],
    ids=["buffered", "lockstep"],
)
async def test_bytes_written_while_reading_do_not_interleave_with_sends(
    transports: TransportPair,
) -> None:
    client, server = await open_post_handshake_auth_pair(transports)
    upload = random.Random(4).randbytes(4 * 1024 * 1024)
    step = 64 * 1024
    received = bytearray()
    question_read = trio.Event()

    async def client_uploads() -> None:
        view = memoryview(upload)
        for start in range(0, len(upload) - step, step):
            await client.send_all(view[start : start + step])
        # The last records go after the client's answer, so the server reads that answer.
        await question_read.wait()
        await client.send_all(view[len(upload) - step :])

    async def client_reads() -> None:
        assert await client.receive_some() == b"who are you?"
        question_read.set()

    async def server_receives(nursery: trio.Nursery) -> None:
        asked = False
        while len(received) < len(upload):
            received.extend(await server.receive_some())
            if len(received) >= len(upload) // 4 and not asked:
                # Mid-upload, ask for the client's certificate.
                server._ssl.verify_client_post_handshake()
                nursery.start_soon(server.send_all, b"who are you?")
                asked = True

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client_uploads)
            nursery.start_soon(client_reads)
            nursery.start_soon(server_receives, nursery)
    # A record split by another would have broken the server's TLS layer.
    assert received == upload
    assert server.getpeercert() is not None
