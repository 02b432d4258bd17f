"""`python -m fleetmend.cli.main ARGS`: the `fleetmend` command run as a module (tests, `dev up` and the
benchmarks start the processes this way). The app is `fleetmend.cli.app`; unlike the console script
(`fleetmend.cli.entry`), `agent` here runs inside the app, not through the lean agent path."""

from fleetmend.cli.app import main

if __name__ == "__main__":  # pragma: no cover
    main()
