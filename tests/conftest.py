"""For every test session: outside an isolated network namespace (scripts/isolated.sh, which `make test` uses),
the servers tests start keep every sandbox off the network (`serve --egress off` through KEEPSTATE_EGRESS), so
no test can reach a real address whatever its sandboxes do. Imports no keepstate: the SDK venvs load it too."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "sdk"))

from sdkharness import isolated  # noqa: E402

if not isolated():
    os.environ["KEEPSTATE_EGRESS"] = "off"
