"""Plumbing: connections, JetStream streams and KV, the lease, the permit pool, metrics, logging,
process signals, the Temporal data converter and credentials. Imports the contract and third-party
libraries, never a process."""
