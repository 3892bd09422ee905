"""Public test fakes for KeepState (shipped, so that users' tests can use them too)."""

from keepstate.testing.fake_provider import FakeProvider, Fault, Served, Stats

__all__ = ["FakeProvider", "Fault", "Served", "Stats"]
