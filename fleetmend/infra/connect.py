"""Connections to NATS and Temporal with errors that say which address failed and what to check."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import nats
import structlog

from fleetmend.config import Settings, TlsSettings

if TYPE_CHECKING:  # types only: the agent imports this module and never loads temporalio
    from nats.aio.client import Client as NATS
    from temporalio.client import Client
    from temporalio.service import TLSConfig
from fleetmend.errors import ConfigError, ServiceUnavailableError
from fleetmend.infra.jetstream import use_replicas


def _read(path: Path | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise ConfigError(f"{what} {path}: {err.strerror or err}; check the file path and permissions") from err


def nats_ssl_context(tls: TlsSettings) -> ssl.SSLContext:
    """An `ssl.SSLContext` for the NATS client: verifies the server against `tls.ca_file` (or the
    system store), presents `tls.cert_file`/`tls.key_file` when set (mutual TLS).

    Raises:
        ConfigError: a file is missing or not valid PEM (names the file).
    """
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH,
                                         cafile=str(tls.ca_file) if tls.ca_file else None)
        if tls.cert_file and tls.key_file:
            ctx.load_cert_chain(str(tls.cert_file), str(tls.key_file))
    except (OSError, ssl.SSLError) as err:
        raise ConfigError(f"NATS TLS files (ca {tls.ca_file}, cert {tls.cert_file}, key {tls.key_file}): {err}; "
                          "check nats_tls.* in the configuration") from err
    return ctx


def nats_auth_options(settings: Settings) -> dict[str, Any]:
    """`nats.connect` keyword options for authentication and TLS from `settings`.

    user/password, an nkey seed file (`nats_nkey_seed`), a `.creds` file, and TLS (`nats_tls`, or a
    `tls://` URL) combine as the server requires.
    """
    opts: dict[str, Any] = {}
    if settings.nats_user:
        opts.update(user=settings.nats_user, password=settings.nats_password)
    if settings.nats_nkey_seed:
        if not Path(settings.nats_nkey_seed).is_file():
            raise ConfigError(f"nats_nkey_seed {settings.nats_nkey_seed}: no such file; "
                              "`fleetmend creds` writes one per node")
        opts.update(nkeys_seed=str(settings.nats_nkey_seed))
    if settings.nats_creds:
        opts.update(user_credentials=str(settings.nats_creds))
    if settings.nats_inbox_prefix:
        opts.update(inbox_prefix=settings.nats_inbox_prefix)
    if settings.nats_tls.active or settings.nats_url.startswith("tls://"):
        opts.update(tls=nats_ssl_context(settings.nats_tls))
        if settings.nats_tls.server_name:
            opts.update(tls_hostname=settings.nats_tls.server_name)
    return opts


def temporal_tls_config(tls: TlsSettings) -> TLSConfig | bool:
    """`temporalio.service.TLSConfig` for `tls`, or False when TLS is off.

    Raises:
        ConfigError: a file cannot be read.
    """
    if not tls.active:
        return False
    from temporalio.service import TLSConfig  # lazy: the node agent imports this module, never temporalio

    return TLSConfig(server_root_ca_cert=_read(tls.ca_file, "temporal_tls.ca_file"),
                     client_cert=_read(tls.cert_file, "temporal_tls.cert_file"),
                     client_private_key=_read(tls.key_file, "temporal_tls.key_file"),
                     domain=tls.server_name)


def nats_servers(url: str) -> list[str]:
    """The servers of a `nats_url` setting (comma-separated for a cluster), in order: what `nats.connect` takes (it
    reads one string as one server, so `nats://a:4222,nats://b:4222` unsplit is "invalid connect url option")."""
    return [u.strip() for u in url.split(",") if u.strip()]


FIRST_CONNECT_RETRY_S = 0.2
"""Seconds between the two tries of each server on a first connect that does not wait forever."""


def _why(err: BaseException | None) -> str:
    """A connection failure in the words an operator searches for: `connection refused`, `timed out`,
    `name not resolved`, else the error's own text (one line)."""
    if err is None:
        return "no answer"
    text = str(err)
    if isinstance(err, ConnectionRefusedError) or "connection refused" in text.lower() \
            or "ConnectionRefused" in text:
        return "connection refused"
    if isinstance(err, (TimeoutError, asyncio.TimeoutError)) or "timed out" in text.lower():
        return "timed out"
    if "Name or service not known" in text or "nodename nor servname" in text or "failed to lookup" in text:
        return "name not resolved"
    return " ".join(f"{type(err).__name__}: {text}".split())[:300]


async def connect_nats(settings: Settings, *, name: str, wait_forever: bool = False, **kw: Any) -> NATS:
    """Connect to `settings.nats_url` (reconnects forever once connected). The process then creates its
    streams and KV buckets with `settings.streams.replicas` (`fleetmend.infra.jetstream.use_replicas`).

    Args:
        name: client name shown by the server (`fleetmend-router`, ...).
        wait_forever: keep trying the first connect too (the agent: its spool holds events meanwhile).
            Otherwise each server of the URL is tried twice, `FIRST_CONNECT_RETRY_S` apart, so a
            refused connection fails in well under a second and an unanswered one within 2 ×
            `nats_connect_timeout_s`; once connected, reconnects are unlimited.
        kw: further `nats.connect` options.
    Raises:
        ServiceUnavailableError: not reachable; the message names the URL, why (`connection refused`,
            `timed out`, ...) and the setting to check.
    """
    log = structlog.get_logger("fleetmend.nats")
    use_replicas(settings.streams.replicas)
    # "quiet": a bounded first connect logs nothing, its failure is the ServiceUnavailableError raised below
    # (a command with NATS away prints its one-line error only, not a log record before it)
    last: dict[str, Any] = {"at": 0.0, "err": None, "quiet": not wait_forever}

    async def error_cb(err: Exception) -> None:
        # one line at most every 30 s instead of nats-py's traceback per reconnect attempt
        last["err"] = err
        if not last["quiet"] and time.monotonic() - last["at"] > 30:
            last["at"] = time.monotonic()
            log.warning("nats_error", url=settings.nats_url, client=name, error=repr(err))

    opts: dict[str, Any] = dict(name=name, connect_timeout=settings.nats_connect_timeout_s,
                                max_reconnect_attempts=-1, reconnect_time_wait=1.0, allow_reconnect=True,
                                error_cb=error_cb)
    opts.update(nats_auth_options(settings))
    opts.update(kw)
    reconnects = opts["max_reconnect_attempts"]
    try:
        if wait_forever:
            return await nats.connect(nats_servers(settings.nats_url), **opts)
        # nats-py's first connect honours max_reconnect_attempts per server (-1: forever); 1 = two tries
        # each, then NoServersError. The client's own `options` then lift the cap for later reconnects.
        wait_s = opts["reconnect_time_wait"]
        opts.update(max_reconnect_attempts=1, reconnect_time_wait=FIRST_CONNECT_RETRY_S)
        async with asyncio.timeout(settings.nats_connect_timeout_s * 2 + FIRST_CONNECT_RETRY_S):
            nc = await nats.connect(nats_servers(settings.nats_url), **opts)
        nc.options.update(max_reconnect_attempts=reconnects, reconnect_time_wait=wait_s)
        last["quiet"] = False
        return nc
    except Exception as err:
        if "authorization violation" in str(err).lower() or "authorization violation" in str(last["err"]).lower():
            raise ServiceUnavailableError(
                f"NATS at {settings.nats_url} refused this client's credentials ({last['err'] or err}); check "
                "nats_user/nats_password, nats_nkey_seed or nats_creds (`fleetmend creds generate` writes them)"
            ) from err
        cause = last["err"] if isinstance(err, (nats.errors.NoServersError, TimeoutError)) and last["err"] else err
        raise ServiceUnavailableError(
            f"cannot reach NATS at {settings.nats_url}: {_why(cause)}; is `fleetmend dev up` (or nats-server) "
            "running? check FLEETMEND_NATS_URL") from err


async def connect_temporal(settings: Settings) -> Client:
    """Connect to Temporal at `settings.temporal_address` with the pydantic data converter.

    Raises:
        ServiceUnavailableError: not reachable within `temporal_connect_timeout_s`, naming the address,
            why (`connection refused`, `timed out`, ...) and FLEETMEND_TEMPORAL_ADDRESS.
    """
    # lazy: the node agent imports this module for NATS and must not load temporalio (tests/test_agent_entry.py)
    from temporalio.client import Client

    from fleetmend.infra.converter import data_converter

    tls = temporal_tls_config(settings.temporal_tls)  # ConfigError for unreadable files, before connecting
    try:
        async with asyncio.timeout(settings.temporal_connect_timeout_s):
            return await Client.connect(settings.temporal_address, namespace=settings.temporal_namespace,
                                        data_converter=data_converter, tls=tls)
    except Exception as err:
        raise ServiceUnavailableError(
            f"cannot reach Temporal at {settings.temporal_address} (namespace {settings.temporal_namespace}): "
            f"{_why(err)}; is `fleetmend dev up` (or the Temporal server) running? check FLEETMEND_TEMPORAL_ADDRESS"
        ) from err


async def close_nats(nc: Any, timeout_s: float = 10.0) -> None:
    """Drain `nc` at exit (pending publishes flushed, subscriptions finished) within `timeout_s`;
    when NATS is away (reconnecting) or the drain does not finish, just close. Never raises: a
    process that is stopping must stop, whatever state the server is in."""
    try:
        if nc.is_connected:
            async with asyncio.timeout(timeout_s):
                await nc.drain()
    except Exception as err:  # noqa: BLE001 - best effort at exit

        structlog.get_logger("fleetmend.nats").warning("nats_drain_failed", error=repr(err))
    finally:
        if not nc.is_closed:
            with contextlib.suppress(Exception):
                await nc.close()
