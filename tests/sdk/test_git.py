"""The SDK's git helpers (`sbx.git`, deprecated by e2b 2.63: git commands run through the agent) on a local
repository: no remote, so no network. clone/pull/push need a git server; the fake internet has none."""

from __future__ import annotations

import pytest
from e2b import Sandbox

pytestmark = pytest.mark.skipif(not hasattr(Sandbox, "git"), reason="this SDK release has no git helpers")

REPO = "/home/user/repo"


def test_init_commit_branch_reset_and_restore(sandbox) -> None:
    git = sandbox.git
    sandbox.commands.run(f"rm -rf {REPO}")
    git.init(REPO, initial_branch="main")
    git.configure_user("K S", "ks@example.test", scope="local", path=REPO)
    sandbox.files.write(f"{REPO}/a.txt", "one\n")
    status = git.status(REPO)
    assert [f.name for f in status.file_status] == ["a.txt"] and not status.is_clean
    git.add(REPO)
    git.commit(REPO, "first")
    assert git.status(REPO).is_clean
    git.create_branch(REPO, "feature")  # and switched to it
    assert git.branches(REPO).current_branch == "feature"
    sandbox.files.write(f"{REPO}/a.txt", "two\n")
    git.restore(REPO, ["a.txt"], worktree=True)
    assert sandbox.files.read(f"{REPO}/a.txt") == "one\n"
    sandbox.files.write(f"{REPO}/b.txt", "b\n")
    git.add(REPO)
    git.commit(REPO, "second")
    git.reset(REPO, mode="hard", target="HEAD~1")
    assert not sandbox.files.exists(f"{REPO}/b.txt")
    git.checkout_branch(REPO, "main")
    git.delete_branch(REPO, "feature", force=True)
    branches = git.branches(REPO)
    assert branches.current_branch == "main" and branches.branches == ["main"]
    log = sandbox.commands.run(f"git -C {REPO} log --format=%s").stdout.split("\n")
    assert log[0] == "first"
