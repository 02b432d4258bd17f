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


async def connect_nats(settings: Settings, *, name: str, wait_forever: bool = False, **kw: Any) -> NATS:
    """Connect to `settings.nats_url` (reconnects forever once connected).

    Args:
        name: client name shown by the server (`fleetmend-router`, ...).
        wait_forever: keep trying the first connect too (the agent: its spool holds events meanwhile).
            Otherwise give up after 2 × `nats_connect_timeout_s` with a clear error.
        kw: further `nats.connect` options.
    Raises:
        ServiceUnavailableError: not reachable (message names the URL and the setting to check).
    """
    log = structlog.get_logger("fleetmend.nats")
    last = {"at": 0.0}

    async def error_cb(err: Exception) -> None:
        # one line at most every 30 s instead of nats-py's traceback per reconnect attempt

        if time.monotonic() - last["at"] > 30:
            last["at"] = time.monotonic()
            log.warning("nats_error", url=settings.nats_url, client=name, error=repr(err))

    opts: dict[str, Any] = dict(name=name, connect_timeout=settings.nats_connect_timeout_s,
                                max_reconnect_attempts=-1, reconnect_time_wait=1.0, allow_reconnect=True,
                                error_cb=error_cb)
    opts.update(nats_auth_options(settings))
    opts.update(kw)
    try:
        if wait_forever:
            return await nats.connect(settings.nats_url, **opts)
        async with asyncio.timeout(settings.nats_connect_timeout_s * 2):
            return await nats.connect(settings.nats_url, **opts)
    except Exception as err:
        if "authorization violation" in str(err).lower():
            raise ServiceUnavailableError(
                f"NATS at {settings.nats_url} refused this client's credentials ({err}); check nats_user/"
                "nats_password, nats_nkey_seed or nats_creds (`fleetmend creds generate` writes them)") from err
        raise ServiceUnavailableError(
            f"cannot reach NATS at {settings.nats_url} ({err!r}); is `fleetmend dev up` (or nats-server) "
            "running? check FLEETMEND_NATS_URL") from err


async def connect_temporal(settings: Settings) -> Client:
    """Connect to Temporal at `settings.temporal_address` with the pydantic data converter.

    Raises:
        ServiceUnavailableError: naming the address and FLEETMEND_TEMPORAL_ADDRESS.
    """
    # lazy: the node agent imports this module for NATS and must not load temporalio (tests/test_agent_entry.py)
    from temporalio.client import Client

    from fleetmend.infra.converter import data_converter

    tls = temporal_tls_config(settings.temporal_tls)  # ConfigError for unreadable files, before connecting
    try:
        return await Client.connect(settings.temporal_address, namespace=settings.temporal_namespace,
                                    data_converter=data_converter, tls=tls)
    except Exception as err:
        raise ServiceUnavailableError(
            f"cannot reach Temporal at {settings.temporal_address} namespace {settings.temporal_namespace} "
            f"({err}); is `fleetmend dev up` (or the Temporal server) running? check FLEETMEND_TEMPORAL_ADDRESS"
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
