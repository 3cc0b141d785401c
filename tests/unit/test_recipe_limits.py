"""Bounded recipe parsing: size, anchors/aliases, nesting depth and node count are refused before
omegaconf builds anything, for recipe files and for override values."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from paddle_fullparam_callbacks.config import ConfigError, list_recipes, load_config
from paddle_fullparam_callbacks.config.recipes import MAX_RECIPE_BYTES, MAX_YAML_DEPTH, MAX_YAML_NODES, check_yaml

BUNDLED = Path(__file__).resolve().parents[2] / "recipes"

BILLION_LAUGHS = "\n".join(
    ["# nine levels of aliases, 10**9 strings once expanded", 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    + [f"{c}: &{c} [{','.join(['*' + p] * 10)}]" for p, c in zip("abcdefgh", "bcdefghi")]
) + "\n"


@pytest.fixture(autouse=True)
def _bundled(isolated_recipes_dir):  # every test here: see conftest.py
    return isolated_recipes_dir


# "fails fast": an unbounded expansion would take minutes; 5 s leaves room for a machine shared with other jobs
# (1 s was seen exceeded, 1.35 s, by a deep-key override while two other test suites ran on its 2 cores)
def _refused(recipe_text, overrides=(), *, key="recipe", match, tmp_path=None, seconds=5.0):
    recipe = None
    if recipe_text is not None:
        recipe = tmp_path / "x.yaml"
        recipe.write_bytes(recipe_text if isinstance(recipe_text, bytes) else recipe_text.encode())
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=match) as info:
        load_config(recipe, list(overrides))
    elapsed = time.perf_counter() - t0
    assert info.value.key == key
    assert elapsed < seconds, f"took {elapsed:.2f}s"
    return info.value


def test_billion_laughs_recipe_fails_fast(tmp_path):
    err = _refused(BILLION_LAUGHS, tmp_path=tmp_path,
                   match=r"x\.yaml: YAML anchors/aliases are not allowed in recipes \(line 2: &a\); write the value out")
    assert str(err).startswith(f"recipe: {tmp_path / 'x.yaml'}: ")


def test_billion_laughs_override_fails_fast():
    value = "[" + ", ".join(f"&{c} [{', '.join(['*' + p] * 10)}]" for p, c in zip("abcdefgh", "bcdefghi")) + "]"
    _refused(None, [f"export.aoa=[&a [lol, lol, lol], {value}]"], key="export.aoa",
             match=r"export\.aoa: the override value: YAML anchors/aliases are not allowed in recipes \(line 1: &a\)")


def test_alias_alone_and_merge_key_are_refused(tmp_path):
    _refused("trigger: *t\n", tmp_path=tmp_path, match=r"\(line 1: \*t\)")
    _refused("base: &base {on_save: true}\ntrigger:\n  <<: *base\n", tmp_path=tmp_path, match=r"\(line 1: &base\)")


def test_file_over_the_size_limit(tmp_path):
    text = "# padding\n" * 200_000  # 2 MB of valid YAML
    _refused(text, tmp_path=tmp_path,
             match=rf"x\.yaml is 2000000 bytes; a recipe may have at most {MAX_RECIPE_BYTES} bytes \(1MB\)")


def test_file_just_under_the_size_limit_loads(tmp_path):
    recipe = tmp_path / "big.yaml"
    body = "trigger:\n  every_n_steps: 7\n"
    recipe.write_text("#" * (MAX_RECIPE_BYTES - len(body) - 1) + "\n" + body)
    assert recipe.stat().st_size == MAX_RECIPE_BYTES
    assert load_config(recipe).trigger.every_n_steps == 7


def test_deep_flow_nesting_fails_fast(tmp_path):
    _refused("export:\n  aoa: " + "[" * 200_000 + "\n", tmp_path=tmp_path,
             match=rf"nested deeper than {MAX_YAML_DEPTH} levels \(line 2\); recipes need 3")


def test_deep_block_nesting(tmp_path):
    text = "".join("  " * i + f"k{i}:\n" for i in range(MAX_YAML_DEPTH + 5))
    _refused(text, tmp_path=tmp_path, match=rf"nested deeper than {MAX_YAML_DEPTH} levels \(line {MAX_YAML_DEPTH + 1}\)")


def test_deep_override_value_and_key_fail_fast():
    _refused(None, ["export.aoa=" + "[" * 200_000], key="export.aoa", match=r"the override value: nested deeper than")
    err = _refused(None, ["a." * 100_000 + "b=1"], key="a." * 40 + "...",
                   match=rf"the key is nested deeper than {MAX_YAML_DEPTH} levels")
    assert len(str(err)) < 300


def test_depth_limit_is_inclusive():
    ok = "[" * MAX_YAML_DEPTH + "]" * MAX_YAML_DEPTH
    check_yaml(ok, "recipe", "r.yaml")
    with pytest.raises(ConfigError, match="nested deeper"):
        check_yaml("[" + ok + "]", "recipe", "r.yaml")


def test_too_many_nodes(tmp_path):
    text = "export:\n  aoa:\n" + "".join(f"    - s{i}\n" for i in range(MAX_YAML_NODES))
    _refused(text, tmp_path=tmp_path,
             match=rf"more than {MAX_YAML_NODES} keys and values \(line {MAX_YAML_NODES - 2}\); a recipe needs a few dozen")


def test_override_too_long():
    _refused(None, ["export.aoa=" + "x" * MAX_RECIPE_BYTES], key="export.aoa",
             match=rf"the override is {MAX_RECIPE_BYTES + 11} characters; at most {MAX_RECIPE_BYTES} bytes")


def test_override_that_does_not_parse_names_its_key():
    _refused(None, ["trigger.every_n_steps=[unclosed"], key="trigger.every_n_steps",
             match=r"the override value does not parse as YAML: while parsing a flow sequence")


def test_recipe_not_utf8(tmp_path):
    _refused(b"trigger:\n  every_n_steps: \xff\n", tmp_path=tmp_path, match=r"does not parse as YAML: it is not UTF-8 text")


def test_bundled_recipes_still_load(monkeypatch):
    monkeypatch.setenv("PFC_RECIPES_DIR", str(BUNDLED))
    names = [n for n, _ in list_recipes()]
    assert names and sorted(names) == sorted(p.stem for p in BUNDLED.glob("*.yaml"))
    for name in names:
        load_config(name)
        check_yaml((BUNDLED / f"{name}.yaml").read_text(), "recipe", name)
