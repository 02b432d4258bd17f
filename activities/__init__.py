"""Every side effect of a remediation, as idempotent Temporal activities.

Each module holds one class that takes its adapter (`SchedulerActivities(scheduler)`,
`TicketActivities(filer)`, `DiagnosticsActivities(nc)`), registered on the worker as bound methods.
"""
