"""Agent ↔ KV bucket, stream and live fixes: the node fingerprint and the reconfigure conversation.

The definitions live in `fleetmend.fingerprint` (the agent imports them without `fleetmend.messages`, which brings
`temporalio.common`); this module is their place in the messages package, for the workflows and activities.
"""

from fleetmend.fingerprint import (
    FINGERPRINT_SCHEMA_VERSION,
    RECONFIGURE_ACTIVITY,
    DeviceRole,
    Fingerprint,
    FingerprintChange,
    FixResult,
    GpuPlacement,
    HardwareClass,
    NicInfo,
    ReconfigureReport,
    ReconfigureRequest,
    TopoLevel,
    fingerprint_change,
)

__all__ = ["FINGERPRINT_SCHEMA_VERSION", "RECONFIGURE_ACTIVITY", "DeviceRole", "Fingerprint", "FingerprintChange",
           "FixResult", "GpuPlacement", "HardwareClass", "NicInfo", "ReconfigureReport", "ReconfigureRequest",
           "TopoLevel", "fingerprint_change"]
