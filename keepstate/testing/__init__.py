"""Public test fakes for KeepState (shipped, so that users' tests can use them too)."""

from keepstate.testing.fake_provider import FakeProvider, Fault, Served, Stats
from keepstate.testing.fake_runtime import FakeRuntime, FakeTemplates
from keepstate.testing.leftovers import leftovers
from keepstate.testing.threaded import fake_provider_in_thread

__all__ = ["FakeProvider", "FakeRuntime", "FakeTemplates", "Fault", "Served", "Stats", "fake_provider_in_thread",
           "leftovers"]
