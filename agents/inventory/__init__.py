"""The node's fingerprint: hardware class, versions, topology and settings read under `agent.host_root`
(`read_fingerprint`), published by `InventoryProbe`; live fixes (`agents.commands.ReconfigureHandler`)."""

from agents.inventory.reader import device_signature, read_fingerprint

__all__ = ["device_signature", "read_fingerprint"]
