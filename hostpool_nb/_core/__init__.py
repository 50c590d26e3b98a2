"""The pools on state arrays: LogicalHostPool, HostPagePool, and the protocol every pool shares."""
