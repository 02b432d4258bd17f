"""What the deployment has kept: `fleetmend tickets` (the ticket ledger) and `fleetmend deadletters` (messages
never valid or never accepted, with their reasons); `deadletter_line`, the dead-letter count that
`fleetmend status` prints last.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Optional

import typer
from rich.markup import escape
from rich.table import Table

from fleetmend import subjects
from fleetmend.cli.common import ConfigOpt, out, run, settings
from fleetmend.config import Settings
from fleetmend.infra.connect import connect_nats
from fleetmend.infra.metrics import deadletter_reason

app = typer.Typer()
"""`fleetmend tickets` and `fleetmend deadletters` (top-level: added to the root app without a group name)."""

REASONS_SCANNED = 500
"""Dead letters whose reasons `fleetmend status` tallies (the newest); the total is always exact."""


@app.command()
def tickets(as_json: bool = typer.Option(False, "--json"), config: Optional[Path] = ConfigOpt) -> None:
    """Tickets in the deployment's ticket ledger (the JetStream KV bucket every worker shares; with
    tickets.ledger = files, the JSON files under state_dir/tickets)."""
    s = settings(config)
    items, where = run(_read_tickets(s))
    if as_json:
        sys.stdout.write(json.dumps(items, default=str, indent=2) + "\n")
        return
    if not items:
        out.print(f"no tickets in {where}")
        return
    t = Table(title=f"tickets ({where})")
    for col in ("ticket", "node", "status", "severity", "fault", "title"):
        t.add_column(col)
    for it in items:
        t.add_row(*(escape(str(it.get(k))) for k in ("ticket_id", "node", "status", "severity", "fault_class",
                                                      "title")))
    out.print(t)


async def _read_tickets(s: Settings) -> tuple[list[dict[str, Any]], str]:
    # lazy: the ticket adapters import temporalio and nats (see fleetmend.cli.common)
    if s.tickets.ledger == "files":
        from activities.ticket_store import LocalTicketStore

        store = LocalTicketStore(s.state_dir / "tickets")
        return await store.list_all(), str(store.directory)
    from activities.ticket_kv import KvTicketStore

    nc = await connect_nats(s, name="fleetmend-cli")
    try:
        kv = KvTicketStore(nc.jetstream())
        return await kv.list_all(), kv.directory
    finally:
        await nc.close()


@app.command()
def deadletters(
    limit: int = typer.Option(20, "--limit"),
    as_json: bool = typer.Option(False, "--json"),
    config: Optional[Path] = ConfigOpt,
) -> None:
    """Dead-lettered messages (never valid, or never accepted) with their reasons."""
    s = settings(config)
    rows = run(_read_deadletters(s, limit))
    if as_json:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return
    if not rows:
        out.print("no dead-lettered messages")
        return
    t = Table(title=f"dead letters (last {len(rows)})")
    for col in ("at", "subject", "reason", "bytes"):
        t.add_column(col)
    for r in rows:
        t.add_row(r.get("at", ""), escape(r.get("subject", "")), escape(r.get("reason", "")),
                  str(r.get("data_bytes", "")))
    out.print(t)


async def _read_deadletters(s: Settings, limit: int) -> list[dict[str, Any]]:
    from nats.js.errors import NotFoundError  # lazy: nats (see fleetmend.cli.common)

    nc = await connect_nats(s, name="fleetmend-cli")
    try:
        js = nc.jetstream()
        try:
            info = await js.stream_info(subjects.DEADLETTER_STREAM)
        except NotFoundError:
            return []
        rows: list[dict[str, Any]] = []
        if not info.state.messages:  # fresh install, or every record aged out
            return rows
        last = info.state.last_seq
        first = max(info.state.first_seq, last - limit + 1, 1)
        for seq in range(first, last + 1):
            try:
                m = await js.get_msg(subjects.DEADLETTER_STREAM, seq)
                rec = json.loads(m.data or b"")
            except (NotFoundError, ValueError):
                continue  # removed by age or limits since the stream_info; or not a record of ours
            rows.append(rec if isinstance(rec, dict) else {"reason": "unreadable record", "at": ""})
        return rows
    finally:
        await nc.close()


async def deadletter_line(settings: Settings, timeout_s: float = 3.0) -> str:
    """One line for `fleetmend status`: how many messages were dead-lettered, by reason.

    `dead letters: 3 (not UTF-8: 1, invalid FaultEvent: 2); details: fleetmend deadletters`, or
    `dead letters: 0`, or `dead letters: unknown (NATS …)` when NATS cannot be asked (status still prints).
    """
    try:
        async with asyncio.timeout(timeout_s * 2):
            nc = await connect_nats(settings, name="fleetmend-status", allow_reconnect=False,
                                    max_reconnect_attempts=0)
            try:
                js = nc.jetstream(timeout=timeout_s)
                try:
                    info = await js.stream_info(subjects.DEADLETTER_STREAM)
                except Exception:  # noqa: BLE001 - no stream yet: nothing was ever dead-lettered
                    return "dead letters: 0"
                total = info.state.messages
                reasons: Counter[str] = Counter()
                first = max(info.state.first_seq, info.state.last_seq - REASONS_SCANNED + 1)
                for seq in range(first, info.state.last_seq + 1) if total else ():
                    try:
                        rec = json.loads((await js.get_msg(subjects.DEADLETTER_STREAM, seq)).data or b"")
                    except Exception:  # noqa: BLE001 - removed by age, or not ours
                        continue
                    reasons[deadletter_reason(str(rec.get("reason", "?")))] += 1
            finally:
                await nc.close()
    except Exception as e:  # noqa: BLE001 - status must print even when NATS is away
        return f"dead letters: unknown (NATS at {settings.nats_url}: {type(e).__name__})"
    if not total:
        return "dead letters: 0"
    by = ", ".join(f"{r}: {n}" for r, n in reasons.most_common())  # a closed set of ≤ 11 categories
    return f"dead letters: {total} ({by}); details: fleetmend deadletters"
