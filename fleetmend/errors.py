"""The error tree. Every fleetmend error derives from `FleetmendError`; subclasses also derive
from the stdlib type they resemble, so `except OSError` still catches a full spool.

    FleetmendError
    ├── ConfigError(ValueError)            bad or missing operator configuration
    ├── CatalogError(ValueError)           fault catalog entry invalid (at load)
    ├── ParseError(ValueError)             a text could not be decoded (kmsg, nvidia-smi, ...)
    ├── InvalidEventError(ValueError)      a wire message can never become a FaultEvent
    ├── SpoolError(OSError)                the agent's on-disk spool could not keep an event
    │   ├── SpoolFullError                 the spool is at its bound (`agent.spool_max_bytes`)
    │   └── SpoolWriteError                the disk refused the write (`reason`: ENOSPC, EROFS, EIO…)
    ├── SchedulerError(RuntimeError)       scontrol / API call failed
    │   └── NodeNotFoundError(LookupError) scheduler does not know the node
    ├── TicketError(RuntimeError)          ticket filing/reading failed
    ├── DiagnosticsError(RuntimeError)     the node agent did not answer a diagnostics request
    └── ServiceUnavailableError(ConnectionError)  NATS/Temporal not reachable (message says where)
"""

from __future__ import annotations


class FleetmendError(Exception):
    """Root of all fleetmend errors."""


class ConfigError(FleetmendError, ValueError):
    pass


class CatalogError(FleetmendError, ValueError):
    pass


class ParseError(FleetmendError, ValueError):
    pass


class InvalidEventError(FleetmendError, ValueError):
    """A message that can never be valid; the router dead-letters it with `reason`."""

    def __init__(self, reason: str, *, subject: str | None = None) -> None:
        super().__init__(f"{reason} (subject {subject})" if subject else reason)
        self.reason = reason
        self.subject = subject


class SpoolError(FleetmendError, OSError):
    """The spool could not keep an event; `reason` is a short, bounded label for logs and metrics."""

    reason = "spool_error"


class SpoolFullError(SpoolError):
    """The spool's size bound would be passed; `directory`, `size_bytes` (on disk) and `max_bytes` (the
    bound, `agent.spool_max_bytes`) say which spool and how full."""

    reason = "spool_full"
    directory: object = None
    size_bytes: int = 0
    max_bytes: int = 0


class SpoolWriteError(SpoolError):
    """A write, fsync or open under the spool directory failed (disk full, read-only, I/O error).

    `reason` is the errno name (`ENOSPC`, `EROFS`, `EDQUOT`, `EIO`, …), `cause` the `OSError`."""

    def __init__(self, message: str, *, reason: str, cause: OSError | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.cause = cause


class SchedulerError(FleetmendError, RuntimeError):
    pass


class NodeNotFoundError(SchedulerError, LookupError):
    pass


class TicketError(FleetmendError, RuntimeError):
    pass


class TicketRejectedError(TicketError):
    """The ticket system refused the request (HTTP 4xx): retrying cannot help.

    Attributes:
        status_code: the HTTP status.
    """

    def __init__(self, message: str, status_code: int) -> None:
        super().__init__(message)
        self.status_code = status_code


class TicketNotFoundError(TicketError, LookupError):
    """No ticket with that id in the store."""


class DiagnosticsError(FleetmendError, RuntimeError):
    pass


class ServiceUnavailableError(FleetmendError, ConnectionError):
    pass
