"""The two sides of EXP-022 as source trees (``harness.trials.commit_compare.trees``)."""

from __future__ import annotations

import pytest

from harness.trials.commit_compare import trees


def test_this_checkout_is_the_tree_of_dot_and_a_bad_ref_is_refused():
    here = trees.resolve(".")
    assert here.root == trees.ROOT and len(here.commit) == 40 and here.label.startswith("here@")
    with pytest.raises(ValueError, match="names no commit"):
        trees.resolve("no-such-ref-anywhere")


def test_a_commit_is_checked_out_once_in_a_worktree_beside_the_checkout():
    first = trees.resolve("HEAD")
    assert first.root.parent == trees.WORKTREES and (first.root / "semantic" / "__init__.py").exists()
    assert trees.resolve(first.commit).root == first.root  # the same worktree, not a second one
