"""Many hosts as one KeepState: membership and leases in the shared database (docs/design/cluster.md)."""
