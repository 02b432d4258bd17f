"""Connections to NATS and Temporal with errors that say which address failed and what to check."""

from __future__ import annotations

from typing import Any

from fleetmend.config import Settings
from fleetmend.errors import ServiceUnavailableError


async def connect_nats(settings: Settings, *, name: str, **kw: Any):  # noqa: ANN201
    """Connect to `settings.nats_url` (reconnects forever once connected).

    Args:
        name: client name shown by the server (`fleetmend-router`, ...).
        kw: further `nats.connect` options.
    Raises:
        ServiceUnavailableError: not reachable (message names the URL and the setting to check).
    """
    import nats

    opts: dict[str, Any] = dict(name=name, connect_timeout=settings.nats_connect_timeout_s,
                                max_reconnect_attempts=-1, reconnect_time_wait=1.0, allow_reconnect=True)
    if settings.nats_user:
        opts.update(user=settings.nats_user, password=settings.nats_password)
    if settings.nats_creds:
        opts.update(user_credentials=str(settings.nats_creds))
    opts.update(kw)
    try:
        return await nats.connect(settings.nats_url, **opts)
    except Exception as err:  # noqa: BLE001 - nats raises several unrelated types here
        raise ServiceUnavailableError(
            f"cannot reach NATS at {settings.nats_url} ({err!r}); is `fleetmend dev up` (or nats-server) "
            "running? check FLEETMEND_NATS_URL") from err


async def connect_temporal(settings: Settings):  # noqa: ANN201
    """Connect to Temporal at `settings.temporal_address` with the pydantic data converter.

    Raises:
        ServiceUnavailableError: naming the address and FLEETMEND_TEMPORAL_ADDRESS.
    """
    from temporalio.client import Client

    from workflows.converter import data_converter

    try:
        return await Client.connect(settings.temporal_address, namespace=settings.temporal_namespace,
                                    data_converter=data_converter)
    except Exception as err:  # noqa: BLE001
        raise ServiceUnavailableError(
            f"cannot reach Temporal at {settings.temporal_address} namespace {settings.temporal_namespace} "
            f"({err}); is `fleetmend dev up` (or the Temporal server) running? check FLEETMEND_TEMPORAL_ADDRESS"
        ) from err
