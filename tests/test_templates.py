"""templates.py: chat templates render as transformers renders them, and hostile ones stop in one line."""
from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from redline import templates
from redline.templates import render_chat_template

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_an_ordinary_template_renders_as_transformers_renders_it():
    from transformers.utils.chat_template_utils import render_jinja_template

    ours = render_chat_template(CHATML, messages=MESSAGES, add_generation_prompt=True)
    theirs = render_jinja_template(conversations=[MESSAGES], chat_template=CHATML, add_generation_prompt=True)[0][0]
    assert ours == theirs


@pytest.mark.parametrize("source, message", [
    ("{% include 'other.jinja' %}", "failed"),
    ("{{ 1 // 0 }}", "failed"),
    ("{{ 1 / 0 }}", "failed"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed too deeply"),
    ("", "rendered nothing"),
    ("{% if false %}x{% endif %}", "rendered nothing"),
    ("{{ 'x' * 100000000000 }}", "limit"),
    ("{{ ['x'] * 100000000000 }}", "limit"),
    ("{% set ns = namespace(s='x' * 1000) %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
     "limit"),
    ("{% set ns = namespace(s='x' * 1000) %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
     "limit"),
    ("{{ 'x'|center(100000000000) }}", "limit"),
    ("{{ 'ab'.ljust(100000000000) }}", "limit"),
    ("{{ 2 ** 100000000 }}", "limit"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{{ 'abcdefgh' }}{% endfor %}{% endfor %}", "limit"),
    ("{{ raise_exception('no system role') }}", "rejected the conversation: no system role"),
    ("{{ messages.__class__ }}", "rendered nothing"),  # the sandbox: internals are undefined
])
def test_a_hostile_template_stops_in_one_line(source, message):
    start = time.monotonic()
    with pytest.raises(ValueError, match=message) as info:
        render_chat_template(source, messages=MESSAGES, add_generation_prompt=True)
    assert "\n" not in str(info.value) and time.monotonic() - start < templates.RENDER_SECONDS + 5


def test_a_template_that_loops_without_output_stops_at_the_time_limit(monkeypatch):
    monkeypatch.setattr(templates, "RENDER_SECONDS", 0.5)
    start = time.monotonic()
    with pytest.raises(ValueError, match="longer than 0.5 s"):
        render_chat_template("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x",
                             messages=MESSAGES)
    assert time.monotonic() - start < 5


def test_the_sandbox_still_refuses_internals():
    with pytest.raises(ValueError, match="rejected|failed"):
        render_chat_template("{{ messages.append({'role': 'user', 'content': 'x'}) }}", messages=MESSAGES)
    with pytest.raises(ValueError):
        render_chat_template("{{ ''.__class__.__mro__[1].__subclasses__() }}", messages=MESSAGES)


PIECES = st.sampled_from(["{{ m['content'] }}", "{% for m in messages %}", "{% endfor %}", "{{ x * 3 }}", "{% if x %}",
                          "{% endif %}", "{{ 'ab' * n }}", "{{ range(n)|join(',') }}", "{{ n // 0 }}", "{{ n ** n }}",
                          "{% set x = x ~ x %}", "{{ x|center(n) }}", "{{ raise_exception('no') }}", "text", "{{",
                          "{% macro f(k) %}{{ f(k) }}{% endmacro %}{{ f(1) }}", "{{ x.__class__ }}"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pieces=st.lists(PIECES, max_size=6), n=st.sampled_from([0, 3, 10 ** 4, 10 ** 12]))
def test_fuzzed_templates_render_or_give_one_line(pieces, n):
    source = "{% set x = 'ab' %}{% set n = " + str(n) + " %}" + "".join(pieces)
    try:
        text = render_chat_template(source, messages=MESSAGES, add_generation_prompt=True)
    except ValueError as exc:
        assert "\n" not in str(exc)
        return
    assert len(text) <= templates.MAX_TEMPLATE_CHARS


@pytest.mark.parametrize("source", ["{{ 1 // 0 }}", "{% include 'x' %}", "{% if false %}{% endif %}"])
def test_a_checkpoints_failing_template_is_a_value_error(sp_tokenizer_dir, tmp_path, source):
    import shutil

    from redline.tokenizer import load_tokenizer

    folder = tmp_path / "tok"
    shutil.copytree(sp_tokenizer_dir, folder)
    (folder / "chat_template.jinja").write_text(source)
    with pytest.raises(ValueError, match="the chat template"):
        load_tokenizer(folder).apply_chat_template(MESSAGES)


def test_a_template_list_without_default_is_refused_as_transformers_refuses_it(sp_tokenizer_dir, tmp_path):
    import json
    import shutil

    from redline.tokenizer import load_tokenizer

    folder = tmp_path / "tok"
    shutil.copytree(sp_tokenizer_dir, folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "{{ 'tools' }}"}, {"name": "rag", "template": "{{ 'rag' }}"}]}))
    with pytest.raises(ValueError, match="without a 'default'"):
        load_tokenizer(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "{{ 'tools' }}"}, {"name": "default", "template": "{{ 'plain' }}"}]}))
    assert load_tokenizer(folder).chat_template == "{{ 'plain' }}"
