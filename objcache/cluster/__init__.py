"""The cluster: chunk placement on a consistent-hash ring, the authenticated peer
protocol, and membership (who is alive). See docs/architecture.md."""
