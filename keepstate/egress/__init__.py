"""A sandbox's way out: policy, firewall, resolver, egress proxy, CA (docs/design/network.md)."""
