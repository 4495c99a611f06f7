"""Which models a server serves and which names reach them (``semantic.serve.fleet.registry``), and the flags that say so.

Pure data: nothing here loads a model. A directory "is a model" for ``--models-dir`` when it holds a
``config.json``; the registry never reads the weights.
"""

from __future__ import annotations

import pytest

from semantic.serve.cli import main, parse_config
from semantic.serve.config import ServeConfig
from semantic.serve.opening import registry_of
from semantic.serve.fleet.registry import (ModelEntry, ModelOptions, Registry, RegistryError, build, parse_alias_arg,
                                     parse_model_arg, read_models_file)

CLAUDE_CODE_NAMES = {  # what Claude Code sends, by version, and where 'claude-*haiku*=small' 'claude-*=main' send it
    "claude-3-5-haiku-20241022": "small",
    "claude-haiku-4-5-20251001": "small",
    "claude-sonnet-4-5-20250929": "main",
    "claude-opus-4-1": "main",
    "claude-3-7-sonnet-latest": "main",
}


def _model_dir(root, name):
    d = root / name
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    return d


def _file(tmp_path, text: str):
    f = tmp_path / "models.toml"
    f.write_text(text)
    return f


# ---------------------------------------------------------------- --model


def test_model_arg_id_equals_dir_names_the_model_and_a_bare_path_does_not():
    assert parse_model_arg("main=/models/gemma") == ("main", "/models/gemma")
    assert parse_model_arg("org/model@v1=mlx-community/SmolLM2") == ("org/model@v1", "mlx-community/SmolLM2")
    assert parse_model_arg("/models/gemma") == (None, "/models/gemma")
    assert parse_model_arg("mlx-community/SmolLM2-135M") == (None, "mlx-community/SmolLM2-135M")


def test_a_path_containing_an_equals_sign_that_exists_is_never_split(tmp_path):
    odd = _model_dir(tmp_path, "run=3")
    assert parse_model_arg(str(odd)) == (None, str(odd))
    assert list(build([str(odd)]).entries) == ["run=3"]  # served alone under its folder's name, as before


def test_one_bare_model_keeps_any_folder_name_or_model_id_as_before_several_models(tmp_path):
    d = _model_dir(tmp_path, "Qwen2.5 Coder (4bit)")
    assert list(build([str(d)]).entries) == ["Qwen2.5 Coder (4bit)"]
    assert list(build([str(d)], model_id="My Model").entries) == ["My Model"]


@pytest.mark.parametrize("value", ["bad id=/m", "=/m", "main=", "-x=/m", "a b=c"])
def test_a_model_arg_with_a_bad_id_is_refused_with_the_form_to_use(value):
    with pytest.raises(RegistryError, match="ID=DIR_OR_HUB_ID"):
        parse_model_arg(value)


@pytest.mark.parametrize("name", ["x" * 129, "has space", ".hidden", "a\nb"])
def test_a_model_id_outside_the_allowed_characters_is_refused(name):
    with pytest.raises(RegistryError, match="letters, digits"):
        Registry([ModelEntry(name, "/m")])


def test_one_bare_model_is_todays_server_pinned_under_its_folders_name_or_model_id(tmp_path):
    d = _model_dir(tmp_path, "gemma-3-270m")
    r = build([str(d)])
    assert r.single and list(r.entries) == ["gemma-3-270m"] and r.entries["gemma-3-270m"].options.pinned
    named = build([str(d)], model_id="gemma")
    assert named.single and named.default == "gemma" and named.entries["gemma"].source == str(d)
    hub = build(["mlx-community/SmolLM2-135M"])
    assert list(hub.entries) == ["mlx-community/SmolLM2-135M"]


def test_several_models_are_not_single_and_not_pinned_and_the_first_is_the_default():
    r = build(["main=/m/a", "small=/m/b"])
    assert not r.single and r.default == "main" and list(r.entries) == ["main", "small"]
    assert not any(e.options.pinned for e in r.entries.values())
    assert not build(["main=/m/a"]).single  # a named model is loaded on demand, even alone


def test_model_id_with_several_models_is_refused():
    with pytest.raises(RegistryError, match="--model-id"):
        build(["main=/m/a", "small=/m/b"], model_id="x")
    with pytest.raises(RegistryError, match="--model-id"):
        build(["/m/a", "/m/b"], model_id="x")


def test_two_ids_on_the_same_weights_are_refused_naming_the_alias_to_give_instead(tmp_path):
    d = _model_dir(tmp_path, "gemma")
    with pytest.raises(RegistryError, match=r"same weights .*alias \(big=main\)"):
        build([f"main={d}", f"big={tmp_path}/./gemma"])
    with pytest.raises(RegistryError, match="same weights"):
        build(["a=org/model", "b=org/model"])  # hub ids: compared as written
    with pytest.raises(RegistryError, match="given twice"):
        build(["a=/m/x", "a=/m/y"])


def test_pin_makes_a_model_pinned_and_an_unknown_pin_is_refused_naming_the_served_ids():
    r = build(["main=/m/a", "small=/m/b"], pins=["small"])
    assert r.entries["small"].options.pinned and not r.entries["main"].options.pinned
    with pytest.raises(RegistryError, match=r"--pin 'big' is not a served model \(served: main, small\)"):
        build(["main=/m/a", "small=/m/b"], pins=["big"])


# ---------------------------------------------------------------- aliases


def _claude_registry(*aliases: str) -> Registry:
    return build(["main=/m/a", "small=/m/b"], aliases=list(aliases))


@pytest.mark.parametrize("order", [("claude-*haiku*=small", "claude-*=main"),
                                   ("claude-*=main", "claude-*haiku*=small")])
def test_claude_codes_real_names_reach_the_most_specific_glob_whatever_the_declaration_order(order):
    r = _claude_registry(*order)
    assert {name: r.resolve(name) for name in CLAUDE_CODE_NAMES} == CLAUDE_CODE_NAMES
    assert r.resolve("Claude-3-5-Haiku") is None  # globs are case-sensitive
    assert r.resolve("gpt-4o") is None
    assert r.resolve(None) == "main"


def test_an_exact_id_beats_an_exact_alias_which_beats_any_glob():
    r = build(["main=/m/a", "small=/m/b", "claude-local=/m/c"],
              aliases=["claude-*=main", "claude-*haiku*=small", "claude-3-5-haiku-20241022=main"])
    assert r.resolve("claude-local") == "claude-local"            # a model's own id, though 'claude-*' matches it
    assert r.resolve("claude-3-5-haiku-20241022") == "main"       # the exact alias, over the more literal glob
    assert r.resolve("claude-haiku-4-5-20251001") == "small"


def test_equally_specific_globs_go_by_declaration_order():
    one = build(["a=/m/a", "b=/m/b"], aliases=["gpt-4*=a", "gpt-*o=b"])  # five literal characters each
    two = build(["a=/m/a", "b=/m/b"], aliases=["gpt-*o=b", "gpt-4*=a"])
    assert one.resolve("gpt-4o") == "a" and two.resolve("gpt-4o") == "b"
    assert one.resolve("gpt-4") == "a" and one.resolve("gpt-3o") == "b"


def test_aliases_that_cannot_be_served_are_refused():
    with pytest.raises(RegistryError, match=r"points at 'big', which is not a served model \(served: main, small\)"):
        _claude_registry("claude-*=big")
    with pytest.raises(RegistryError, match="a model's own id"):
        _claude_registry("small=main")
    with pytest.raises(RegistryError, match="given twice"):
        _claude_registry("claude-*=main", "claude-*=small")
    with pytest.raises(RegistryError, match="without spaces"):
        _claude_registry("claude *=main")
    with pytest.raises(RegistryError, match="PATTERN=MODEL_ID"):
        parse_alias_arg("claude-*")
    assert parse_alias_arg("a=b=main") == ("a=b", "main")  # the id is what follows the last '='


def test_served_names_list_ids_and_aliases_for_a_404():
    said = _claude_registry("claude-*=main").served_names()
    assert said == "models 'main', 'small'; aliases claude-*→main"
    assert _claude_registry().aliases_of("main") == []


# ---------------------------------------------------------------- --models-file

FULL_FILE = """
[defaults]
idle_ttl_s = 600
pool_mb = 256

[models.main]
path = "weights/gemma"
aliases = ["claude-*", "gpt-*"]
pinned = true
max_context = 32768
kv_bits = 8
pool_mb = 1024
ram_mb = 512
disk_mb = 4096
idle_ttl_s = 0
tool_parser = "json_tools"

[models.small]
path = "mlx-community/SmolLM2-135M"

[aliases]
"claude-*haiku*" = "small"
"""


def test_a_models_file_gives_each_model_its_options_over_the_defaults_over_the_flags(tmp_path):
    weights = _model_dir(tmp_path / "weights", "gemma")
    f = _file(tmp_path, FULL_FILE)
    entries, aliases, defaults = read_models_file(str(f), ModelOptions(kv_bits=4, idle_ttl_s=5.0))
    main, small = entries
    assert main.id == "main" and main.source == str(weights.resolve())  # relative to the file's folder
    assert main.options == ModelOptions(pinned=True, idle_ttl_s=0.0, max_context=32768, kv_bits=8, pool_mb=1024,
                                        ram_mb=512, disk_mb=4096, tool_parser="json_tools")
    assert small.source == "mlx-community/SmolLM2-135M"  # not a folder beside the file: a hub id, as written
    assert small.options == ModelOptions(idle_ttl_s=600.0, pool_mb=256, kv_bits=4)  # [defaults] over the flags
    assert defaults == small.options
    assert aliases == [("claude-*", "main"), ("gpt-*", "main"), ("claude-*haiku*", "small")]


def test_build_serves_the_files_models_first_then_the_flags_with_the_files_defaults(tmp_path):
    _model_dir(tmp_path / "weights", "gemma")
    f = _file(tmp_path, FULL_FILE)
    r = build(["extra=/m/extra"], models_file=str(f), aliases=["o1*=small"], pins=["small"])
    assert list(r.entries) == ["main", "small", "extra"] and r.default == "main" and not r.single
    assert r.entries["extra"].options.idle_ttl_s == 600.0 and r.entries["small"].options.pinned
    assert {n: r.resolve(n) for n in CLAUDE_CODE_NAMES} == CLAUDE_CODE_NAMES
    assert r.resolve("gpt-4o") == "main" and r.resolve("o1-mini") == "small"
    assert r.aliases_of("main") == ["claude-*", "gpt-*"]


@pytest.mark.parametrize("text, message", [
    ("[model.main]\npath = 'x'\n", "unknown table 'model'"),
    ("[models.main]\npath = 'x'\npool = 3\n", "models.main: unknown key 'pool'"),
    ("[defaults]\nttl = 3\n", "defaults: unknown key 'ttl'"),
    ("[defaults]\npath = 'x'\n", r"\[defaults\] holds per-model options"),
    ("[models.main]\nkv_bits = 8\n", r"\[models.main\] needs path"),
    ("[models.main]\npath = 'x'\nkv_bits = 7\n", r"models.main.kv_bits must be one of \(2, 3, 4, 5, 6, 8\), got 7"),
    ("[models.main]\npath = 'x'\nkv_bits = true\n", "kv_bits must be one of"),
    ("[models.main]\npath = 'x'\nidle_ttl_s = -1\n", "idle_ttl_s must be a number of seconds >= 0"),
    ("[models.main]\npath = 'x'\nidle_ttl_s = '10'\n", "idle_ttl_s must be a number"),
    ("[models.main]\npath = 'x'\nidle_ttl_s = true\n", "idle_ttl_s must be a number"),
    ("[models.main]\npath = 'x'\npool_mb = 0\n", "models.main.pool_mb must be a positive integer"),
    ("[models.main]\npath = 'x'\nmax_context = 1.5\n", "max_context must be a positive integer"),
    ("[models.main]\npath = 'x'\npinned = 'yes'\n", "pinned must be true or false"),
    ("[models.main]\npath = 'x'\ntool_parser = ''\n", "tool_parser must name a parser"),
    ("[models.main]\npath = 'x'\npool_mb = 64\nram_mb = 128\n", "ram_mb 128 exceeds pool_mb 64"),
    ("[models.main]\npath = 'x'\naliases = 'claude-*'\n", "aliases must be a list"),
    ("[models.main]\npath = 'x'\n[aliases]\nx = 3\n", r"\[aliases\] maps names"),
    ("[models.main\n", "not TOML"),
])
def test_a_models_file_that_cannot_be_served_is_refused_naming_what_to_fix(tmp_path, text, message):
    with pytest.raises(RegistryError, match=message):
        read_models_file(str(_file(tmp_path, text)))


def test_a_missing_models_file_and_a_files_bad_alias_are_refused(tmp_path):
    with pytest.raises(RegistryError, match="cannot read it"):
        read_models_file(str(tmp_path / "nope.toml"))
    f = _file(tmp_path, "[models.main]\npath = 'x'\n[aliases]\n'claude-*' = 'small'\n")
    with pytest.raises(RegistryError, match="points at 'small'"):
        build([], models_file=str(f))


# ---------------------------------------------------------------- --models-dir


def test_models_dir_serves_each_folder_with_a_config_by_its_name(tmp_path):
    root = tmp_path / "models"
    for name in ("gemma", "smollm"):
        _model_dir(root, name)
    (root / "notes").mkdir()                    # no config.json: not a model
    _model_dir(root, "has space")               # not an id clients could send
    r = build([], models_dir=str(root), defaults=ModelOptions(idle_ttl_s=30.0))
    assert list(r.entries) == ["gemma", "smollm"] and r.default == "gemma"
    assert r.entries["smollm"].source == str(root / "smollm") and r.entries["smollm"].options.idle_ttl_s == 30.0


def test_models_dir_finds_a_folder_added_later_when_a_request_names_it(tmp_path):
    root = tmp_path / "models"
    _model_dir(root, "gemma")
    r = build([], models_dir=str(root), aliases=["claude-*=gemma"])
    assert r.resolve("qwen") is None
    _model_dir(root, "qwen")
    assert r.resolve("qwen") == "qwen" and list(r.entries) == ["gemma", "qwen"]
    assert r.resolve("claude-x") == "gemma" and not r.rescan()  # nothing new: no entry added twice


def test_models_dir_skips_a_folder_already_served_under_another_id(tmp_path):
    root = tmp_path / "models"
    d = _model_dir(root, "gemma")
    _model_dir(root, "qwen")
    r = build([f"main={d}"], models_dir=str(root))
    assert list(r.entries) == ["main", "qwen"]


def test_an_empty_models_dir_or_no_model_at_all_is_refused(tmp_path):
    with pytest.raises(RegistryError, match="no model directory"):
        build([], models_dir=str(tmp_path))
    with pytest.raises(RegistryError, match="no model to serve"):
        Registry([])


# ---------------------------------------------------------------- the command line


def test_the_new_flags_reach_the_config_and_the_registry():
    cfg = parse_config(["--model", "main=/m/a", "--model", "small=/m/b", "--alias", "claude-*haiku*=small",
                        "--alias", "claude-*=main", "--pin", "main", "--models-mb", "2048", "--idle-ttl", "2.5",
                        "--kv-bits", "8", "--max-context", "1024"])
    assert cfg.models == ("main=/m/a", "small=/m/b") and cfg.aliases == ("claude-*haiku*=small", "claude-*=main")
    assert cfg.pins == ("main",) and cfg.models_mb == 2048 and cfg.idle_ttl_s == 2.5 and cfg.kv_bits == 8
    r = registry_of(cfg)
    assert r.entries["main"].options == ModelOptions(pinned=True, idle_ttl_s=2.5, max_context=1024, kv_bits=8)
    assert r.entries["small"].options == ModelOptions(idle_ttl_s=2.5, max_context=1024, kv_bits=8)
    assert {n: r.resolve(n) for n in CLAUDE_CODE_NAMES} == CLAUDE_CODE_NAMES


def test_one_bare_model_keeps_todays_flags_and_defaults():
    cfg = parse_config(["--model", "/m/a", "--model-id", "tiny"])
    assert cfg.models == ("/m/a",) and cfg.model_id == "tiny" and cfg.models_mb is None and cfg.idle_ttl_s == 0
    r = registry_of(cfg)
    assert r.single and list(r.entries) == ["tiny"] and r.entries["tiny"].options.idle_ttl_s is None


def test_a_models_file_or_a_models_dir_alone_is_enough_to_serve(tmp_path):
    assert parse_config(["--models-file", "m.toml"]).models_file == "m.toml"
    assert parse_config(["--models-dir", str(tmp_path)]).models_dir == str(tmp_path)
    assert ServeConfig(model="/m/a", models=("b=/m/b", "/m/a")).models == ("/m/a", "b=/m/b")


@pytest.mark.parametrize("argv", [[], ["--model", "m", "--models-mb", "0"], ["--model", "m", "--idle-ttl", "-1"],
                                  ["--model", "m", "--kv-bits", "7"], ["--model", " "]])
def test_bad_model_flags_exit_with_the_usage_line(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parse_config(argv)
    assert e.value.code == 2 and "usage: semantic serve" in capsys.readouterr().err


def test_model_id_with_several_models_is_refused_when_the_registry_is_built():
    cfg = parse_config(["--model", "main=/m/a", "--model", "/m/b", "--model-id", "x"])
    with pytest.raises(RegistryError, match="--model-id names the one model"):
        registry_of(cfg)


def test_the_server_exits_2_naming_the_flag_before_loading_any_model(capsys):
    assert main(["serve", "--model", "main=/m/a", "--model", "small=/m/b", "--model-id", "x"]) == 2
    assert "error: --model-id names the one model of a single --model DIR" in capsys.readouterr().err
    assert main(["--model", "main=/m/a", "--pin", "big"]) == 2
    assert "error: --pin 'big' is not a served model (served: main)" in capsys.readouterr().err
