"""The chat template rendered by jinja2 alone (packtools.pipeline.tokenizer.chat.render) equals transformers' rendering,
and a renderer that differs is caught and replaced by transformers with the reason (packtools.pipeline.tokenizer.chat.tokens)."""

from __future__ import annotations

import os

import pyarrow as pa
import pytest

pytest.importorskip("transformers")
from transformers import PreTrainedTokenizerFast  # noqa: E402

from packtools.errors import PackingError
from packtools.pipeline.tokenizer import adversarial
from packtools.pipeline.tokenizer import fast as fast_tokenize
from packtools.pipeline.tokenizer.batch import BatchTokenizer  # noqa: E402
from packtools.pipeline.tokenizer.chat import tokens as chat  # noqa: E402
from packtools.pipeline.tokenizer.chat import values as chat_values
from packtools.pipeline.tokenizer.chat.render import ChatRenderer, read_settings  # noqa: E402

# a template that uses what transformers' environment gives: loop controls, namespace, tojson, raise_exception,
# trim/lstrip blocks, reasoning aliases, bos/eos variables, and {% generation %} spans
TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(n=0) %}
{% for m in messages %}
    {% if m['role'] == 'bad' %}{{ raise_exception('bad role') }}{% endif %}
    {% set ns.n = ns.n + 1 %}
    {% if m['role'] == 'assistant' %}
<|im_start|>assistant {{ ns.n }}
{% generation %}{% if m.thinking is defined %}<think>{{ m.thinking | trim }}</think>{% endif %}{{ m['content'] }}{{ eos_token }}{% endgeneration %}
    {% else %}
<|im_start|>{{ m['role'] }} {{ {'k': m['content'][:3]} | tojson }}
{{ m['content'] }}<|im_end|>
    {% endif %}
    {% if loop.index > 40 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant {{ ns.n + 1 }}
{% endif %}"""


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    path = str(tmp_path_factory.mktemp("tok"))
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    ).save_pretrained(path)
    with open(os.path.join(path, "chat_template.jinja"), "w") as fh:
        fh.write(TEMPLATE)
    return path


def conversations():
    texts = adversarial.adversarial_texts(["<s>", "</s>", "<|im_start|>"])
    convs = adversarial.adversarial_conversations(texts)
    convs.append(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": " r "}]
    )
    convs.append([{"role": "bad", "content": "x"}])
    return convs


def test_jinja_alone_renders_as_transformers(tokdir):
    tok = BatchTokenizer(tokdir, "messages", engine="transformers").tok
    template, specials = read_settings(tokdir)
    assert template == TEMPLATE and specials == tok.special_tokens_map
    mine, theirs = ChatRenderer(template, specials), chat.TransformersRenderer(tok)
    convs = conversations()
    assert chat.render_difference(mine, theirs, convs, tags=True) is None
    text, spans = mine.render_spans(convs[-2])
    assert [text[a:b] for a, b in spans] == ["<think>r</think>a</s>"]  # the aliased reasoning, in its span


def test_a_renderer_that_differs_is_caught(tokdir, monkeypatch):
    """Negative control: jinja2 without transformers' lstrip_blocks renders other whitespace; the proof sees it
    and the run renders with transformers, saying why."""
    import jinja2.sandbox

    tok = BatchTokenizer(tokdir, "messages", engine="transformers").tok
    real = jinja2.sandbox.ImmutableSandboxedEnvironment

    class WithoutLstrip(real):  # packtools subclasses the sandbox
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "lstrip_blocks": False})

    monkeypatch.setattr(jinja2.sandbox, "ImmutableSandboxedEnvironment", WithoutLstrip)
    mine = ChatRenderer(*read_settings(tokdir))
    assert (
        chat.render_difference(mine, chat.TransformersRenderer(tok), conversations(), tags=True) is not None
    )
    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", "")  # no recorded verdict
    bt = BatchTokenizer(tokdir, "messages")
    out = bt(pa.table({"messages": [conversations()[0]]}))
    assert bt.chat.render_engine.startswith("transformers (jinja2 alone rendered differently")
    assert isinstance(bt.chat.renderer, chat.TransformersRenderer) and out.num_rows == 1


def test_chat_needs_no_transformers_once_proven(tokdir, tmp_path, monkeypatch):
    """The second tokenizer of the same folder renders, encodes and labels without loading transformers, with
    the same ids and labels as transformers' own path."""
    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", str(tmp_path / "cache"))
    convs = conversations()[:-1]
    table = pa.table({"messages": convs})
    first = BatchTokenizer(tokdir, "messages")
    want = BatchTokenizer(tokdir, "messages", engine="transformers")(table)
    assert first(table).equals(want)
    second = BatchTokenizer(tokdir, "messages")
    got = second(table)
    assert second._tok is None, "transformers was loaded"
    assert isinstance(second.chat.renderer, ChatRenderer) and got.equals(want)
    assert second.chat.render_engine.startswith("jinja2")


@pytest.mark.skipif(fast_tokenize.engine_version() is None, reason="needs packtools[fast]")
def test_rows_not_nfc_take_the_reference_and_the_rest_stay_fast(tmp_path, monkeypatch):
    """An NFC tokenizer: the rows of a batch whose rendering is not NFC go through the reference, the others stay
    on the fast engine (and are proven), and the rows come back in their order with transformers' ids and labels."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", str(tmp_path / "cache"))
    vocab = {c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    path = str(tmp_path / "tok")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", chat_template=TEMPLATE).save_pretrained(
        path
    )
    convs = [
        [
            {"role": "user", "content": str(i) + (" cafe\u0301" if i % 2 else " café")},
            {"role": "assistant", "content": "ok"},
        ]
        for i in range(6)
    ]
    table = pa.table({"messages": convs})
    want = BatchTokenizer(path, "messages", engine="transformers")(table)
    bt = BatchTokenizer(path, "messages")
    assert bt.fast is not None, bt.report.reason
    bt.start_part("p")
    got = bt(table)
    assert got.equals(want)
    checked = bt.part_report()["checked"]
    assert checked["batches_on_transformers"] == 1 and checked["rows_checked"] == 3  # the 3 NFC rows, fast


# templates that touch what a render's context holds: top-level sets (context.vars), namespaces, loops over the
# messages and their prefixes, globals (range, dict, namespace, lipsum's absence of use), errors, and undefined
STATEFUL_TEMPLATES = [
    TEMPLATE,
    "{% set top = messages | length %}{{ top }}{% for m in messages %}{{ loop.index }}{{ m.content }}"
    "{% if loop.last %}|{{ top }}{% endif %}{% endfor %}{% if add_generation_prompt %}>{% endif %}",
    "{% for i in range(messages | length) %}{{ dict(a=i) | tojson }}{{ messages[i].role }}{% endfor %}"
    "{{ tools }}{{ documents }}{{ unknown }}{{ bos_token }}",
    "{% if messages[-1].role == 'user' %}{{ raise_exception('last is ' ~ messages[-1].content) }}{% endif %}"
    "{{ messages | map(attribute='content') | join(',') }}",
    "{{ messages[0].nope.deeper }}",
]


@pytest.mark.parametrize("template", STATEFUL_TEMPLATES)
def test_render_equals_jinja_template_render(template):
    """ChatRenderer's render (its own context, the globals flattened once) gives what jinja2's own
    ``Template.render`` gives on the same variables, every prefix with and without the generation prompt, and
    raises the same; ``render_prefixes`` gives the prefixes' renders lazily, in order."""
    from packtools.pipeline.tokenizer.chat.render import template_messages

    mine = ChatRenderer(template, {"bos_token": "<s>", "eos_token": "</s>"})

    def jinja(conv, prompt):
        return mine._compiled.render(
            messages=template_messages(conv), add_generation_prompt=prompt, **mine._variables
        )

    for conv in conversations()[:-1]:
        cuts = [(k, prompt) for k in range(1, len(conv) + 1) for prompt in (False, True)]
        prefixes = mine.render_prefixes(conv, cuts)
        for k, prompt in cuts:
            want = chat_values._outcome(jinja, conv[:k], prompt)
            assert chat_values._outcome(mine.render, conv[:k], prompt) == want
            assert chat_values._outcome(next, prefixes) == want
            if isinstance(want, tuple):  # raised: a generator that raised is finished
                prefixes = mine.render_prefixes(conv, cuts[cuts.index((k, prompt)) + 1 :])


def test_messages_are_shared_unless_reasoning_is_aliased():
    from packtools.pipeline.tokenizer.chat.render import template_messages

    plain = {"role": "user", "content": "q"}
    aliased = {"role": "assistant", "content": "a", "reasoning": "r", "thinking": None}
    out = template_messages([plain, aliased])
    assert out[0] is plain
    assert out[1] == {
        "thinking": None,
        "role": "assistant",
        "content": "a",
        "reasoning": "r",
        "reasoning_content": "r",
    }  # the message's own keys win, but for reasoning_content
    assert template_messages([{"role": "user", "thinking": None}])[0] == {"role": "user", "thinking": None}


@pytest.mark.parametrize(
    "template",
    [
        "{% for m in messages %}{{ m.get('content') }}{{ m.update({'content': 'x'}) }}{% endfor %}",
        "{% for m in messages %}{{ m['content'].__class__.__mro__ }}{% endfor %}",
        "{{ messages.append(messages[0]) }}",
        "{% for m in messages %}{{ m.items().__class__ }}{{ m.pop('role') }}{% endfor %}",
    ],
    ids=["dict-update", "str-dunder", "list-append", "dict-pop"],
)
def test_the_remembered_sandbox_verdicts_still_refuse(template):
    """The sandbox remembers its verdict per (built-in type, attribute): a refused attribute stays refused on
    every render, after allowed ones of the same type, as jinja2's own sandbox refuses it."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    mine = ChatRenderer(template, {})
    plain = ImmutableSandboxedEnvironment().from_string(template)
    for _ in range(3):  # the first render decides, the next ones read the remembered verdicts
        with pytest.raises(jinja2.exceptions.SecurityError):
            mine.render(conv, False)
        with pytest.raises(jinja2.exceptions.SecurityError):
            plain.render(messages=conv)
    assert conv == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]


def test_chat_batches_before_the_fast_engine_has_loaded_go_to_the_reference(tokdir, tmp_path, monkeypatch):
    """Chat data overlaps the fast engine's load as text does: with both verdicts recorded, the first batch is
    labelled by the reference (the same ids and labels), counted and reported, the next waits for the engine."""
    import threading

    from _pipeline_data import hold_fast_engine_load

    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", str(tmp_path / "cache"))
    convs = [c for c in conversations() if c[0]["role"] != "bad"][:20]
    table = pa.table({"messages": convs})
    want = BatchTokenizer(tokdir, "messages", engine="transformers")(table)
    BatchTokenizer(tokdir, "messages")  # records the verdicts
    BatchTokenizer(tokdir, "messages")
    release = hold_fast_engine_load(monkeypatch)
    bt = BatchTokenizer(tokdir, "messages", wait_for_engine=False)
    assert bt.pending is not None and bt.fast is None
    bt.start_part("p")
    first = bt(table)
    assert first.equals(want) and bt.fast is None
    report = bt.part_report()
    assert report["engine"] == "transformers" and "still loading" in report["reason"]
    threading.Timer(0.2, release.set).start()
    second = bt(table)  # waits for the load, then the fast path with its proof
    assert second.equals(want) and bt.fast is not None
    report = bt.part_report()
    assert report["engine"].startswith("fastokens") and report["checked"]["batches_on_transformers"] == 1


def test_chat_batches_are_rendered_while_the_fast_engine_loads_then_finished_by_it(
    tokdir, tmp_path, monkeypatch
):
    """The pipeline's chat stage renders batches while the engine loads (batch.render_while_loading) and the
    engine finishes them: the same tables, in order, as calls, and no batch on the reference; past the cap of
    batches held, the first one goes to the reference and the next wait (take_pending's rule)."""
    import threading

    from _pipeline_data import hold_fast_engine_load

    from packtools.pipeline.tokenizer import batch

    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", str(tmp_path / "cache"))
    convs = [c for c in conversations() if c[0]["role"] != "bad"][:24]
    batches = [pa.table({"messages": convs[i : i + 3]}) for i in range(0, len(convs), 3)]
    want = [BatchTokenizer(tokdir, "messages", engine="transformers")(b) for b in batches]
    BatchTokenizer(tokdir, "messages")  # records the verdicts
    for cap in (100, 2):
        release = hold_fast_engine_load(monkeypatch)
        monkeypatch.setattr(batch, "AHEAD_BATCHES", cap)
        bt = BatchTokenizer(tokdir, "messages", wait_for_engine=False)
        bt.start_part("p")
        prepared = []
        real_prepare = bt.prepare

        def prepare(table, where, bt=bt, real_prepare=real_prepare, prepared=prepared, release=release):
            prepared.append(where)
            if len(prepared) == 3:  # the engine has loaded once three batches were rendered
                release.set()
                bt.pending.result()
            return real_prepare(table, where)

        bt.prepare = prepare
        if cap == 2:
            threading.Timer(0.3, release.set).start()
        got = list(batch.render_while_loading(bt, iter(enumerate(batches))))
        assert [w for w, _ in got] == list(range(len(batches)))
        assert all(t.equals(w) for (_, t), w in zip(got, want))
        assert prepared == list(range(min(cap, 3)))
        report = bt.part_report()
        assert report["engine"].startswith("fastokens")
        assert report["checked"].get("batches_on_transformers", 0) == (0 if cap > 3 else 1)


def test_a_batch_that_fails_while_rendered_ahead_names_its_row(tokdir, tmp_path, monkeypatch):
    from _pipeline_data import hold_fast_engine_load

    from packtools.pipeline.tokenizer import batch

    monkeypatch.setenv("PACKTOOLS_CACHE_DIR", str(tmp_path / "cache"))
    BatchTokenizer(tokdir, "messages")  # records the verdicts
    BatchTokenizer(tokdir, "messages")
    release = hold_fast_engine_load(monkeypatch)
    bt = BatchTokenizer(tokdir, "messages", wait_for_engine=False)
    assert bt.engine_loading()
    bt.start_part("p")
    good = [c for c in conversations() if c[0]["role"] != "bad"][:2]
    bad = pa.table({"messages": [good[0], [{"role": "bad", "content": "x"}]]})  # the template raises on it
    try:
        with pytest.raises(PackingError, match=r"row 11\b.*bad role"):
            list(batch.render_while_loading(bt, iter([(0, pa.table({"messages": good})), (10, bad)])))
        assert bt.engine_loading()  # the error came from rendering ahead, before the engine was there
    finally:
        release.set()


@pytest.mark.skipif(fast_tokenize.engine_version() is None, reason="needs packtools[fast]")
def test_a_chat_batch_the_fast_engine_raises_on_is_counted_once_with_its_reason(tokdir, monkeypatch):
    """An engine error on a chat batch (auto): transformers' ids and labels, the batch counted once on
    transformers, and the reason the error's (negative control: a batch without the trigger stays fast)."""
    from _pipeline_data import fail_fast_engine

    convs = [
        [
            {"role": "user", "content": f"q{i}" + (" boom" if i == 1 else "")},
            {"role": "assistant", "content": "a"},
        ]
        for i in range(4)
    ]
    table = pa.table({"messages": convs})
    want = BatchTokenizer(tokdir, "messages", engine="transformers")(table)
    bt = BatchTokenizer(tokdir, "messages")
    assert bt.fast is not None, bt.report.reason
    fail_fast_engine(monkeypatch, lambda t: "boom" in t, RuntimeError, "match limit exceeded")
    bt.start_part("p")
    assert bt(table).equals(want)
    report = bt.part_report()
    assert report["checked"]["batches_on_transformers"] == 1
    assert "match limit exceeded" in report["batches_on_transformers_why"]
    bt.start_part("q")
    quiet = pa.table({"messages": [convs[0], convs[2]]})
    assert bt(quiet).equals(BatchTokenizer(tokdir, "messages", engine="transformers")(quiet))
    assert bt.part_report()["checked"].get("batches_on_transformers", 0) == 0
