"""The map and the words tell the truth: the module map is what the tree generates, and no docstring,
comment or doc names a module that does not exist (``harness.codemap``)."""

from __future__ import annotations

from harness import codemap


def test_the_module_map_is_what_the_tree_generates():
    assert codemap.MAP.read_text() == codemap.render(), "docs/code-map.md is stale: run `make code-map`"


def test_no_docstring_comment_or_doc_names_a_module_that_does_not_exist():
    assert codemap.dangling() == []


def test_a_renamed_module_left_in_a_docstring_is_caught(tmp_path, monkeypatch):
    """The check itself can fail: a docstring naming a module that was renamed away."""
    stale = tmp_path / "semantic" / "stale.py"
    stale.parent.mkdir()
    stale.write_text('"""Reads ``windowkeep`` and ``semantic.cache.stops`` and ``engine/steploop.py``."""\n')
    monkeypatch.setattr(codemap, "_sources", lambda: [stale])
    monkeypatch.setattr(codemap, "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("see `semantic/runner/steploop.py`\n")
    named = {name for _, name in codemap.dangling()}
    assert {"windowkeep", "semantic.cache.stops", "engine/steploop.py", "semantic/runner/steploop.py"} <= named
