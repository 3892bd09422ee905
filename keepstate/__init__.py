"""KeepState: self-hosted, E2B-compatible sandboxes whose sessions are durable."""

__version__ = "0.1.0"
