"""One render per conversation (packtools.pipeline.tokenizer.chat.local) against the incremental rule by prefix renders."""

from __future__ import annotations

import functools

import pytest
from _real_vocab import OFFICIAL, TEMPLATES
from hypothesis import given, settings
from hypothesis import strategies as st
from jinja2 import TemplateError

from packtools.errors import PackingError
from packtools.pipeline.tokenizer import adversarial
from packtools.pipeline.tokenizer.chat import labels as chat_labels
from packtools.pipeline.tokenizer.chat.local import local_shape
from packtools.pipeline.tokenizer.chat.render import ChatRenderer

SPECIALS = {"bos_token": "<s>", "eos_token": "</s>"}
ROLES = ["system", "user", "assistant", "tool"]
pieces = st.sampled_from(
    ["", " ", "\n", "  x  ", "<s>", "</s>", "<|eot_id|>", "ab\n\n", "\u00e9\u0301", "\t"]
)
contents = st.lists(st.one_of(pieces, st.text(max_size=8)), max_size=4).map("".join)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(ROLES), "content": contents},
    optional={"reasoning_content": contents},
)
conversations = st.lists(message, min_size=1, max_size=6)

# an instance of the shape whose generation prompt does not start the assistant turn: not incremental
NOT_INCREMENTAL = (
    "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<gen>{% endif %}"
)


@functools.cache
def _prefix_rendered(plain: str) -> ChatRenderer:
    return ChatRenderer(plain, SPECIALS)


@functools.cache
def _one_render(plain: str) -> ChatRenderer:
    r = ChatRenderer(plain, SPECIALS)
    convs = adversarial.adversarial_conversations(adversarial.adversarial_texts(list(SPECIALS.values())))
    why = r.enable_local(
        convs,
        lambda c: (lambda t, s: (t[0], s[0]))(
            *chat_labels.incremental_spans(_prefix_rendered(plain), [c], str)
        ),
    )
    assert why is None, why
    return r


def _outcome(renderer: ChatRenderer, conv: list) -> object:
    try:
        return chat_labels.incremental_spans(renderer, [conv], lambda i: f"row {i}")
    except (PackingError, ValueError, TemplateError) as exc:  # TemplateError: the template's raise_exception
        return type(exc).__name__, str(exc)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@settings(max_examples=80, deadline=None)
@given(convs=st.lists(conversations, min_size=1, max_size=4))
def test_one_render_gives_the_prefix_renders_spans_and_errors(name, convs):
    plain = TEMPLATES[name][0]
    fast, slow = _one_render(plain), _prefix_rendered(plain)
    assert fast.local is not None and slow.local is None
    for conv in convs:
        assert _outcome(fast, conv) == _outcome(slow, conv)


@settings(max_examples=100, deadline=None)
@given(conv=conversations)
def test_a_template_that_is_not_incremental_still_gets_the_rules_error(conv):
    assert local_shape(NOT_INCREMENTAL) is not None  # the shape holds; the incremental rule does not
    fast = _one_render(NOT_INCREMENTAL)  # (the adversarial conversations all fail the rule: none to compare)
    got, want = _outcome(fast, conv), _outcome(_prefix_rendered(NOT_INCREMENTAL), conv)
    assert got == want
    if conv[0]["role"] != "assistant" and any(m["role"] == "assistant" for m in conv[1:]):
        assert "does not render conversations incrementally" in str(got)


def test_the_marker_changes_no_rendering():
    plain = TEMPLATES["qwen3-think"][0]
    fast, slow = _one_render(plain), _prefix_rendered(plain)
    conv = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": " hi "},
        {"role": "assistant", "content": "yo", "reasoning_content": " think "},
    ]
    text, spans = fast.local_spans(conv)
    assert text == slow.render(conv, False)
    assert [text[a:b] for a, b in spans] == ["<think>\nthink\n</think>\n\nyo<|im_end|>\n"]


LOOP = "{% for m in messages %}X{% endfor %}"
GEN = "{% if add_generation_prompt %}<a>{% endif %}"
# Templates of the wider shape: loop position, the first message, sets in the head and the body.
WIDER = {
    **{name: plain for name, (plain, _) in OFFICIAL.items()},
    "loop-index": LOOP.replace(
        "X", "{{ loop.index }}{% if loop.first %}F{% endif %}<{{ m['role'] }}>{{ m['content'] }}"
    )
    + GEN,
    "first-message": "{% if messages[0]['role'] == 'system' %}S{% endif %}"
    + LOOP.replace("X", "{{ messages[0]['content'] }}<{{ m['role'] }}>{{ m['content'] }}")
    + GEN,
    "set-before-read": "{% set x = 'h' %}"  # the body reads the head's x before its own set: it lasts one iteration
    + LOOP.replace(
        "X", "[{{ x }}]{% if m['role'] == 'user' %}{% set x = m['content'] %}{% endif %}<{{ m['role'] }}>"
    )
    + GEN,
    "inner-loop-index": LOOP.replace(
        "X", "<{{ m['role'] }}>{% for c in m['content'] %}{{ loop.index }}{{ c }}{% endfor %}"
    )
    + GEN,
}


@pytest.mark.parametrize("name", sorted(WIDER))
@settings(max_examples=80, deadline=None)
@given(convs=st.lists(conversations, min_size=1, max_size=4))
def test_the_wider_shape_gives_the_prefix_renders_spans_and_errors(name, convs):
    plain = WIDER[name]
    assert local_shape(plain) is not None
    fast, slow = _one_render(plain), _prefix_rendered(plain)
    for conv in convs:
        assert _outcome(fast, conv) == _outcome(slow, conv)


@pytest.mark.parametrize(
    "template",
    [
        LOOP.replace("X", "{% if loop.last %}{{ m['content'] }}{% endif %}"),  # depends on later messages
        LOOP.replace("X", "{{ loop.length }}{{ m['content'] }}"),
        LOOP.replace("X", "{{ loop.revindex0 }}"),
        LOOP.replace("X", "{{ loop }}"),
        LOOP.replace("X", "{{ messages[1]['content'] }}{{ m['content'] }}"),  # another message than the first
        LOOP.replace("X", "{{ messages[-1]['content'] }}"),
        LOOP.replace("X", "{{ messages[loop.index0 + 1]['role'] }}"),
        LOOP.replace("X", "{{ messages | length }}"),
        "{% if messages | length > 2 %}S{% endif %}" + LOOP.replace("X", "{{ m['content'] }}"),
        "{% set messages = messages[1:] %}"
        + LOOP.replace("X", "{{ m['content'] }}"),  # Llama 3.1's system split
        "{% set ms = messages %}{% set ms = messages %}"
        + LOOP.replace("messages", "ms").replace("X", "{{ m }}"),
        "{% set ms = messages %}" + LOOP.replace("messages", "ms").replace("X", "{{ ms | length }}"),
        "{% set ms = messages %}" + LOOP.replace("X", "{% set ms = 1 %}{{ m }}"),  # the alias set again
        "{% set h = messages[0]['role'] %}"
        + LOOP.replace("X", "{{ m['content'] }}")
        + "{{ h }}",  # tail reads h
        LOOP.replace("X", "{% set c = m['content'] %}{{ c }}")
        + "{% if add_generation_prompt %}{{ c }}{% endif %}",
        "{% set ns = namespace(n=0) %}" + LOOP.replace("X", "{% set ns.n = ns.n + 1 %}{{ ns.n }}"),  # state
        LOOP.replace("X", "{% set add_generation_prompt = true %}{{ m['content'] }}"),
        LOOP.replace("X", "{% set m = 1 %}{{ m }}"),
        LOOP.replace("X", "{% if m['role'] == 'x' %}{% break %}{% endif %}{{ m['content'] }}"),
        LOOP.replace(
            "X", "{% if add_generation_prompt %}G{% endif %}{{ m['content'] }}"
        ),  # prompt in the body
        "{% if add_generation_prompt %}G{% endif %}" + LOOP.replace("X", "{{ m['content'] }}"),  # in the head
        "{% set c %}x{% endset %}" + LOOP.replace("X", "{{ c }}{{ m['content'] }}"),  # a block set
        LOOP.replace("X", "{{ strftime_now('%d') }}"),  # a clock
        LOOP.replace("X", "{{ m['content'] | random }}"),  # a filter with randomness
        LOOP.replace("X", "{{ m.update({'a': 1}) }}"),  # a method not on the list
        LOOP.replace("X", "{{ range(3) | list }}"),
        LOOP.replace("X", "{% for c in m['content'] %}{{ loop.last }}{% endfor %}"),  # an inner loop's state
        LOOP + LOOP,  # two loops over the messages
        LOOP.replace("X", "{{ m['content'] }}") + "{{ m }}",  # the loop variable after the loop
        "{% for m in messages if m['role'] != 'x' %}{{ m['content'] }}{% endfor %}",  # a filtered loop
        "{% macro f(x) %}{{ x }}{% endmacro %}" + LOOP.replace("X", "{{ f(m['content']) }}"),
        "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}",
    ],
)
def test_templates_outside_the_shape_are_refused(template):
    assert local_shape(template) is None
    r = ChatRenderer(template, SPECIALS) if "generation" not in template else None
    if r is not None:
        assert r.enable_local([], lambda c: None) is not None and r.local is None
