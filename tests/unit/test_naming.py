"""export.name_template: the naming contract, one test per refusal, properties of valid templates."""
from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paddle_fullparam_callbacks.config import ConfigError, ExportConfig, load_config
from paddle_fullparam_callbacks.plan.naming import (
    MAX_NAME_BYTES,
    MAX_STEP,
    _first_violation,
    format_snapshot_name,
    name_problem,
    snapshot_step_pattern,
    sort_bound,
    validate_template,
)

# template -> regex on the message (after "export.name_template: "); one entry per message
BAD = {
    "not-a-format-string": ("hf-{step", r"'hf-\{step' is not a format string: "),
    "other-field": ("x-{step}-{epoch}", r"may use only the field \{step\}; it has \{epoch\}"),
    "positional-field": ("hf-{}", r"may use only the field \{step\}; it has \{\}"),
    "attribute-of-step": ("hf-{step.real}", r"it has \{step\.real\}"),
    "field-in-spec": ("hf-{step:{w}d}", r"it has \{w\} inside \{step:\{w\}d\}"),
    "no-step": ("fixed", r"'fixed' does not depend on the step; include \{step\}"),
    "step-twice": ("{step}-{step}", r"has \{step\} 2 times; use it exactly once"),
    "conversion-r": ("hf-{step!r}", r"converts the step with !r; drop the conversion"),
    "conversion-s": ("hf-{step!s}", r"converts the step with !s"),
    "exponent": (
        "hf-{step:.0e}",
        r"formats the step with ':\.0e', not as a decimal integer: steps 10 and 11 both give 'hf-1e\+01' "
        r"\(names must be distinct\)\. Use \{step\}, \{step:d\} or \{step:0Nd\}",
    ),
    "hex": ("hf-{step:x}", r"':x', not as a decimal integer: step 10 gives 'hf-a', which the snapshot pattern does not match"),
    "binary": ("hf-{step:b}", r"':b', not as a decimal integer: step 2 gives 'hf-10', which the snapshot pattern reads back as step 10"),
    "locale-n": ("hf-{step:n}", r"formats the step with ':n', not as a decimal integer\. Use"),
    "precision": ("hf-{step:.3}", r"formatting step 0 fails: Precision not allowed"),
    "too-long": ("{step:0>300}", rf"step 0 gives a name of 300 bytes .* at most {MAX_NAME_BYTES} bytes for every step up to {MAX_STEP}"),
    "too-long-late": ("x" * 190 + "{step}", r"step 10000000000 gives a name of 201 bytes"),
    "slash": ("a/b-{step}", r"step 0 gives 'a/b-0', which is not one safe directory name: no '/' or '\\' allowed"),
    "dotdot": ("../x-{step}", r"gives '\.\./x-0'"),
    "leading-dot": (".hf-{step}", r"gives '\.hf-0', .*starts with '\.' \(dot-names in output_dir are the staging, trash and lock entries\)"),
    "trailing-space": ("hf-{step} ", r"gives 'hf-0 ', .*spaces at an end or characters that do not print"),
    "space-padding": ("hf-{step:6d}", r"gives 'hf-     0', .*letters, digits and \. _ \+ = -"),
    "non-ascii": ("é-{step}", r"gives 'é-0', .*letters, digits"),
    "collision": ("hf-{step:0<6}", r"steps 1 and 10 both give 'hf-100000' \(names must be distinct\)"),
    "grouping": ("hf-{step:_}", r"step 1000 gives 'hf-1_000', which the snapshot pattern does not match \(retention and `best`"),
    "sign": ("hf-{step:+d}", r"step 0 gives 'hf-\+0', which the snapshot pattern does not match"),
    "fill-digit": ("hf-{step:1>6}", r"steps 0 and 10 both give 'hf-111110' \(names must be distinct\)"),
}


@pytest.mark.parametrize("template, match", list(BAD.values()), ids=list(BAD))
def test_bad_template_is_refused_on_load(template, match):
    with pytest.raises(ConfigError, match=match) as info:
        load_config(None, [f"export.name_template='{template}'"])  # quoted: '{' starts a YAML mapping
    assert info.value.key == "export.name_template"
    assert str(info.value).startswith("export.name_template: ")


@pytest.mark.parametrize("template, match", [
    (5, r"must be a string such as 'hf-step-\{step:06d\}'; got 5"),
    ("hf-\0{step}", r"contains a NUL character"),
    ("hf\\{step}", r"no '/' or '\\' allowed"),
    ("hf\t{step}", r"characters that do not print"),
])
def test_bad_template_built_in_python(template, match):
    with pytest.raises(ConfigError, match=match) as info:
        ExportConfig(name_template=template)
    assert info.value.key == "export.name_template"


def test_order_violation_names_both_steps():
    # unreachable through a template that reads back (its digits have a fixed width below the
    # bound); the check stays as the last line of defence, so its message is tested directly
    msg = _first_violation(lambda s: f"n{s}", re.compile(r"^n([0-9]+)$"), 99, range(20))
    assert msg == "steps 9 and 10 give 'n9' and 'n10', which sort the other way as strings (names must sort in step order up to step 99)"


@pytest.mark.parametrize("template", [
    "hf-step-{step:06d}", "hf-{step}", "hf-{step:d}", "v2-{step:03d}", "{step:0>6}", "{step:0=6}", "{step:#06d}",
    "{step}1", "1{step}", "x" * 181 + "{step}", "{step:019d}", "run=a+b_c.{step:08d}",
])
def test_good_templates_are_accepted(template):
    validate_template(template)
    assert load_config(None, [f"export.name_template='{template}'"]).export.name_template == template


def test_pattern_matches_exactly_the_names_of_the_template():
    p = snapshot_step_pattern("hf-step-{step:06d}")
    assert int(p.match("hf-step-000500").group(1)) == 500
    assert int(p.match("hf-step-1000000").group(1)) == 10**6
    for foreign in ("hf-step-0500", "hf-step-0000500", "hf-step-01000000", "hf-step-00050a", "hf-step-٠٠٠٥٠٠",
                    "xhf-step-000500", "hf-step-000500x", ".tmp-hf-step-000500-deadbeef"):
        assert p.match(foreign) is None, foreign
    q = snapshot_step_pattern("a.{step}")  # the literal '.' is escaped
    assert q.match("a.7") and not q.match("ab7") and not q.match("a.07")


def test_sort_bound():
    assert sort_bound("hf-step-{step:06d}") == 999_999
    assert sort_bound("hf-{step}") == 9
    assert sort_bound("{step:025d}") == MAX_STEP
    assert sort_bound("hf-{step:x}") == 0


def test_format_snapshot_name_at_run_time():
    assert format_snapshot_name("hf-step-{step:06d}", 12) == "hf-step-000012"
    with pytest.raises(ValueError, match=r"gives 'a/b-3' for step 3: no '/'"):
        format_snapshot_name("a/b-{step}", 3)
    with pytest.raises(ValueError, match=r"must use only the field \{step\}"):
        format_snapshot_name("{epoch}-{step}", 3)


def test_name_problem():
    assert name_problem("hf-step-000001") is None
    assert "pointer file" in name_problem("latest")
    assert "bytes long" in name_problem("a" * (MAX_NAME_BYTES + 1))


# ---- properties of generated valid templates ------------------------------------------------
SAFE = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._+=-"
ALNUM = SAFE[:62]
prefixes = st.one_of(st.just(""), st.tuples(st.sampled_from(ALNUM), st.text(SAFE, max_size=30)).map("".join))
fields = st.one_of(st.just("{step}"), st.just("{step:d}"), st.integers(1, 19).map(lambda n: f"{{step:0{n}d}}"))
templates = st.tuples(prefixes, fields, st.text(SAFE, max_size=30)).map("".join)
steps = st.one_of(st.integers(0, 10**7), st.integers(0, MAX_STEP))


@settings(max_examples=300, deadline=None)
@given(templates, steps, steps)
def test_valid_templates_round_trip_distinct_ordered(template, a, b):
    validate_template(template)
    pattern = snapshot_step_pattern(template)
    name_a, name_b = format_snapshot_name(template, a), format_snapshot_name(template, b)
    assert int(pattern.match(name_a).group(1)) == a  # name -> step, exactly
    assert int(pattern.match(name_b).group(1)) == b
    assert (name_a == name_b) == (a == b)  # distinct
    bound = sort_bound(template)
    if max(a, b) <= bound:
        assert (name_a < name_b) == (a < b)  # `ls` order is step order up to the bound
    assert len(name_a.encode()) <= MAX_NAME_BYTES and name_problem(name_a) is None


@settings(max_examples=100, deadline=None)
@given(templates)
def test_sort_bound_is_tight(template):
    bound = sort_bound(template)
    assert bound >= 9
    if bound < MAX_STEP:  # the first step past the bound lists before the bound's own name
        assert format_snapshot_name(template, bound + 1) < format_snapshot_name(template, bound)


@settings(max_examples=100, deadline=None)
@given(prefixes, st.sampled_from("bcoxXneEfFgG%"), st.text(SAFE, max_size=10))
def test_non_decimal_presentations_are_refused(prefix, presentation, suffix):
    with pytest.raises(ValueError, match="not as a decimal integer"):
        validate_template(f"{prefix}{{step:{presentation}}}{suffix}")
