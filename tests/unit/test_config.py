"""Config loading: recipes, overrides, validation errors naming the key, size parsing."""
from __future__ import annotations

import pytest

from paddle_fullparam_callbacks.config import (
    ConfigError,
    ExportConfig,
    FullParamConfig,
    RetentionConfig,
    TriggerConfig,
    coerce_config,
    load_config,
    parse_size,
)


@pytest.fixture(autouse=True)
def _bundled(isolated_recipes_dir):  # every test here: see conftest.py
    return isolated_recipes_dir


# (recipe file text or None, overrides, expected ConfigError.key, regex on the message)
BAD = {
    "unknown-top-level-key": (None, ["foo=1"], "foo", r"unknown key; the top level has: output_dir, enabled, trigger"),
    "unknown-nested-key": (None, ["trigger.foo=1"], "trigger.foo", r"unknown key; section 'trigger' has: every_n_steps"),
    "string-for-int": (None, ["trigger.every_n_steps=abc"], "trigger.every_n_steps", r"'abc'.*Integer"),
    "float-for-int": (None, ["retention.keep_last=1.5"], "retention.keep_last", r"'1\.5'.*Integer"),
    "string-for-bool": (None, ["enabled=maybe"], "enabled", r"'maybe' is not a valid bool"),
    "negative-every_n_steps": (None, ["trigger.every_n_steps=-1"], "trigger.every_n_steps", r">= 1 .*got -1"),
    "zero-every_n_steps": (None, ["trigger.every_n_steps=0"], "trigger.every_n_steps", r">= 1 \(leave it unset, or null, to turn this trigger off\); got 0"),
    "negative-keep_last": (None, ["retention.keep_last=-2"], "retention.keep_last", r">= 0 .*got -2"),
    "size-bad-unit": (None, ["export.max_shard_size=5XB"], "export.max_shard_size", r"not a size: '5XB'"),
    "size-empty": (None, ["export.max_shard_size="], "export.max_shard_size", r"None"),
    "size-negative": (None, ["export.max_shard_size=-1GB"], "export.max_shard_size", r"not a size: '-1GB'"),
    "size-unit-only": (None, ["export.max_shard_size=GB"], "export.max_shard_size", r"not a size: 'GB'"),
    "size-zero": (None, ["export.max_pending_bytes=0"], "export.max_pending_bytes", r"must be positive"),
    "max_pending-not-auto": (None, ["export.max_pending_bytes=automatic"], "export.max_pending_bytes",
                             r"not a size: 'automatic'.*; or auto"),
    "unknown-dtype": (None, ["export.dtype=int8"], "export.dtype", r"one of keep, bfloat16, float16, float32; got 'int8'"),
    "unknown-format": (None, ["export.format=onnx"], "export.format", r"one of hf_safetensors, .*got 'onnx'"),
    "unknown-assembler": (None, ["assembler=fast"], "assembler", r"one of builtin, paddle; got 'fast'"),
    "unknown-on_error": (None, ["on_error=ignore"], "on_error", r"one of warn, raise; got 'ignore'"),
    "template-dotdot": (None, ["export.name_template=../x-{step}"], "export.name_template", r"gives '\.\./x-0'"),
    "template-slash": (None, ["export.name_template=a/b-{step}"], "export.name_template", r"gives 'a/b-0'.*no '/'"),
    "template-absolute": (None, ["export.name_template=/abs-{step}"], "export.name_template", r"gives '/abs-0'"),
    "template-no-step": (None, ["export.name_template=fixed"], "export.name_template", r"does not depend on the step"),
    "template-other-field": (
        None, ["export.name_template=x-{step}-{epoch}"], "export.name_template", r"only the field \{step\}.*epoch",
    ),
    "aoa-number": (None, ["export.aoa=5"], "export.aoa", r"list of statements; got 5"),
    "aoa-list-with-number": (None, ["export.aoa=[a, 5]"], "export.aoa", r"got \['a', 5\]"),
    "callable-missing": (None, ["export.format=callable"], "export.callable", r"needs export\.callable="),
    "callable-without-format": (None, ["export.callable=m:f"], "export.callable", r"export\.format is 'hf_safetensors'"),
    "paddle-format-with-aoa": (
        None, ["export.format=paddle_safetensors", "export.aoa=llama"], "export.aoa", r"leave export\.aoa at 'auto'",
    ),
    "override-without-equals": (None, ["trigger.every_n_steps"], "trigger.every_n_steps", r"key=value"),
    "override-empty-key": (None, ["=5"], "=5", r"key=value"),
    "override-interpolation": (None, ["output_dir=${oc.env:HOME}"], "output_dir", r"interpolations"),
    "recipe-not-yaml": ("trigger: [unclosed\n  x: : :\n", [], "recipe", r"does not parse as YAML"),
    "recipe-is-list": ("- a\n- b\n", [], "recipe", r"must hold a mapping of keys, not ListConfig"),
    "recipe-interpolation": ("output_dir: ${oc.env:HOME}\n", [], "output_dir", r"interpolations .* not allowed"),
    "recipe-nested-interpolation": (
        "trigger:\n  every_n_steps: ${retention.keep_last}\n", [], "trigger.every_n_steps", r"interpolations",
    ),
    "recipe-unknown-nested-key": ("export:\n  shard: 1GB\n", [], "export.shard", r"unknown key"),
    "recipe-wrong-type": ("retention:\n  keep_last: many\n", [], "retention.keep_last", r"'many'.*Integer"),
}


@pytest.mark.parametrize("recipe_text, overrides, key, match", list(BAD.values()), ids=list(BAD))
def test_bad_config_names_the_key(tmp_path, recipe_text, overrides, key, match):
    recipe = None
    if recipe_text is not None:
        recipe = tmp_path / "recipe.yaml"
        recipe.write_text(recipe_text)
    with pytest.raises(ConfigError, match=match) as info:
        load_config(recipe, overrides)
    assert info.value.key == key
    assert str(info.value).startswith(f"{key}: ")
    assert isinstance(info.value, ValueError)


def test_nonexistent_recipe_name(isolated_recipes_dir):
    (isolated_recipes_dir / "small.yaml").write_text("# a small recipe\ntrigger:\n  every_n_steps: 3\n")
    with pytest.raises(ConfigError, match=r"no recipe file 'no-such-recipe'; bundled recipes: small") as info:
        load_config("no-such-recipe")
    assert info.value.key == "recipe"


def test_bundled_recipe_by_name(isolated_recipes_dir):
    (isolated_recipes_dir / "small.yaml").write_text("trigger:\n  every_n_steps: 3\n")
    assert load_config("small").trigger.every_n_steps == 3
    assert load_config("small.yaml").trigger.every_n_steps == 3


def test_defaults():
    cfg = load_config()
    assert cfg == FullParamConfig()
    assert cfg.export.max_shard_bytes == 5 * 10**9
    assert cfg.export.max_pending == 512 * 10**6
    assert cfg.trigger.every_n_steps is None and cfg.retention.keep_last == 0


def test_max_pending_bytes_auto_by_default_a_size_still_accepted():
    cfg = load_config()
    # auto: the async ring is sized from the rank's bytes; the synchronous writer keeps 512MB
    assert cfg.export.max_pending_bytes == "auto" and cfg.export.max_pending_auto
    assert cfg.export.max_pending == 512 * 10**6
    two = load_config(None, ["export.max_pending_bytes=2GB"]).export
    assert not two.max_pending_auto and two.max_pending == 2 * 10**9
    assert ExportConfig(max_pending_bytes="1MiB").max_pending == 2**20
    assert load_config(None, ["export.max_pending_bytes=auto"]).export.max_pending_auto


def test_recipe_file_merged_with_overrides(tmp_path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(
        "output_dir: /data/snaps\n"
        "trigger:\n  every_n_steps: 10\n  on_evaluate: true\n"
        "export:\n  max_shard_size: 1GB\n  dtype: bfloat16\n"
        "retention:\n  keep_last: 3\n"
    )
    cfg = load_config(recipe, ["trigger.every_n_steps=25", "export.max_shard_size=500MB"])
    assert isinstance(cfg, FullParamConfig)
    assert cfg.trigger.every_n_steps == 25  # the override wins
    assert cfg.export.max_shard_size == "500MB" and cfg.export.max_shard_bytes == 500 * 10**6
    assert cfg.trigger.on_evaluate is True  # the recipe's value stays where not overridden
    assert cfg.export.dtype == "bfloat16"
    assert cfg.retention.keep_last == 3
    assert cfg.output_dir == "/data/snaps"
    assert cfg.on_error == "warn"  # the schema default fills what the recipe omits
    assert load_config(str(recipe)).trigger.every_n_steps == 10


def test_aoa_list_of_statements(tmp_path):
    recipe = tmp_path / "aoa.yaml"
    recipe.write_text("export:\n  aoa:\n    - 'a -> b'\n    - 'c -> d'\n")
    assert load_config(recipe).export.aoa == ["a -> b", "c -> d"]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("5GB", 5 * 10**9),
        ("500MB", 500 * 10**6),
        ("2GiB", 2 * 2**30),
        ("1.5GB", 1_500_000_000),
        ("1KiB", 1024),
        ("7", 7),
        (" 3 kb ", 3000),
        (4096, 4096),
    ],
)
def test_parse_size_good(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("value", ["5XB", "", "-1GB", "GB", "1e3", "0", 0, -5, True, "0.0000001KB"])
def test_parse_size_bad(value):
    with pytest.raises(ValueError, match=r"size|not a size|not a whole number of bytes"):
        parse_size(value)


def test_coerce_config_from_dict():
    cfg = coerce_config(
        {"trigger": {"every_n_steps": 7}, "export": {"dtype": "float16", "max_shard_size": "2GiB"}},
        ["retention.keep_last=2"],
    )
    assert cfg.trigger.every_n_steps == 7
    assert cfg.export.dtype == "float16" and cfg.export.max_shard_bytes == 2 * 2**30
    assert cfg.retention.keep_last == 2
    with pytest.raises(ConfigError, match=r"got -3") as info:
        coerce_config({"retention": {"keep_last": -3}})
    assert info.value.key == "retention.keep_last"


def test_coerce_config_from_object_with_overrides():
    base = FullParamConfig(trigger=TriggerConfig(every_n_steps=4), retention=RetentionConfig(keep_last=1))
    assert coerce_config(base) is base
    cfg = coerce_config(base, ["trigger.every_n_steps=9", "export.dtype=bfloat16"])
    assert cfg.trigger.every_n_steps == 9 and cfg.export.dtype == "bfloat16"
    assert cfg.retention.keep_last == 1
    assert base.trigger.every_n_steps == 4  # the input is not modified
    with pytest.raises(ConfigError, match=r">= 1") as info:
        coerce_config(base, ["trigger.every_n_steps=-1"])
    assert info.value.key == "trigger.every_n_steps"
    with pytest.raises(ConfigError) as info:
        coerce_config(base, ["nokey=1"])
    assert info.value.key == "nokey"


def test_coerce_config_none_and_recipe(tmp_path):
    assert coerce_config(None) == FullParamConfig()
    recipe = tmp_path / "r.yaml"
    recipe.write_text("on_error: raise\n")
    assert coerce_config(recipe, ["assembler=paddle"]).on_error == "raise"
    assert coerce_config(str(recipe), ["assembler=paddle"]).assembler == "paddle"


def test_schema_validates_when_built_in_python():
    with pytest.raises(ConfigError, match=r"got -1") as info:
        TriggerConfig(every_n_steps=-1)
    assert info.value.key == "trigger.every_n_steps"
    with pytest.raises(ConfigError) as info:
        ExportConfig(max_shard_size="5XB")
    assert info.value.key == "export.max_shard_size"
    with pytest.raises(ConfigError) as info:
        FullParamConfig(output_dir="  ")
    assert info.value.key == "output_dir"


# ---- regressions of bugs found and fixed -----------------------------------------------------
def test_coerce_config_dict_keeps_none():
    assert coerce_config({"output_dir": None}).output_dir is None


def test_coerce_config_dict_keeps_strings_verbatim():
    assert coerce_config({"output_dir": "true"}).output_dir == "true"


def test_coerce_config_dict_accepts_valid_template():
    assert coerce_config({"export": {"name_template": "{step:06d}"}}).export.name_template == "{step:06d}"


def test_coerce_config_object_rejects_interpolation():
    with pytest.raises(ConfigError, match="interpolations"):
        coerce_config(FullParamConfig(), ["output_dir=${oc.env:HOME}"])


def test_parse_size_decimal_is_exact():
    assert parse_size("1.001GB") == 1_001_000_000


def test_scalar_for_section_names_the_section():
    with pytest.raises(ConfigError, match=r"trigger: is a section of keys, not a value") as info:
        load_config(None, ["trigger=5"])
    assert info.value.key == "trigger"


def test_a_text_field_takes_an_unquoted_brace_value_as_text():
    # export.name_template={step:06d} on a command line: YAML alone would read a mapping
    assert load_config(None, ["export.name_template={step:06d}"]).export.name_template == "{step:06d}"
    assert load_config(None, ["export.name_template='{step:04d}-x'"]).export.name_template == "{step:04d}-x"
    with pytest.raises(ConfigError, match=r"^export.name_template: '\{step!r\}' converts the step with !r"):
        load_config(None, ["export.name_template={step!r}"])
    with pytest.raises(ConfigError, match=r"^trigger.every_n_steps"):  # not a text field: YAML's reading stands
        load_config(None, ["trigger.every_n_steps={a: 1}"])


@pytest.mark.parametrize("override, message", [
    ("trigger.evry_n_steps=3", r"^trigger.evry_n_steps: unknown key; section 'trigger' has: every_n_steps, .*"
                               r"Did you mean 'trigger.every_n_steps'\?"),
    ("trigerr.every_n_steps=3", r"^trigerr: unknown key; the top level has: .*trigger.*Did you mean 'trigger'\?"),
    ("on_error=NO", r"^on_error: must be one of warn, raise; got the YAML boolean false \(unquoted yes/no"),
    ("export.max_shard_size=1.9B", r"^export.max_shard_size: '1.9B' is not a whole number of bytes"),
    ("export.max_shard_size=\uff110MB", r"^export.max_shard_size: not a size"),  # full-width digits
    ("trigger.min_interval_s=.inf", r"^trigger.min_interval_s: must be a number of seconds >= 0; got inf"),
    ("topology.sharding_stage=0", r"^topology.sharding_stage: must be 1, 2 or 3"),
    ("export.timeout_s=0", r"^export.timeout_s: must be a number of seconds > 0"),
    ("export.callable=:", r"^export.callable: the override value does not parse as YAML"),
])
def test_numbers_and_names_are_checked_where_they_are_read(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_output_dir_expands_the_home_directory():
    import os

    assert load_config(None, ["output_dir=~/snaps"]).output_dir == os.path.join(os.path.expanduser("~"), "snaps")


@pytest.mark.parametrize("overrides, exports_on_save", [
    ([], True),  # nothing else asked: snapshots follow the trainer's saves
    (["trigger.every_n_steps=5"], False),  # a cadence was asked for: exactly that one
    (["trigger.on_evaluate=true"], False),
    (["trigger.every_n_steps=5", "trigger.on_save=true"], True),  # said explicitly: both
    (["trigger.on_save=false"], False),
])
def test_on_save_by_default_only_without_another_cadence(overrides, exports_on_save):
    assert load_config(None, overrides).trigger.exports_on_save is exports_on_save
