"""What a pool knows of its own use: tracking, state snapshots and their checks, recordings."""
