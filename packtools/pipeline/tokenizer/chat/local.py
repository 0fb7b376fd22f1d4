"""One render instead of one per prefix, for chat templates whose loop body depends on its message alone.

Without ``{% generation %}`` markers, the incremental rule (:mod:`.labels`) renders the prefixes around every
assistant turn: four renders of a user/assistant/user/assistant row.  Many templates have a shape that makes
those renders predictable:

    HEAD  {% for m in messages %} BODY {% endfor %}  TAIL

where HEAD reads neither ``add_generation_prompt`` nor ``messages`` beyond ``messages[0]`` (it may name an alias,
``{% set loop_messages = messages %}``, to loop over), BODY reads its message ``m``, ``messages[0]``, the
position-only loop state ``loop.index0`` / ``loop.index`` / ``loop.first``, names it sets itself and constants (no
``loop.last`` or ``loop.length``, no other message, no ``namespace``, no ``break``), and TAIL reads
``add_generation_prompt`` and constants only (no name HEAD or BODY sets).  Every prefix ``messages[:k]`` (``k >= 1``)
has the same first message and gives message ``i`` the same index, and a ``{% set %}`` in the loop body lasts one
iteration (jinja2's scoping rule; ``tests/test_chat_local.py`` holds the renders to it), so BODY's output for
message ``i`` is the same in every render that contains it.  :func:`local_shape` checks that on the template's
syntax tree, conservatively: a node, filter, test, method or name outside the lists below makes it answer None,
and the caller keeps rendering prefixes.
For such a template the rendering of ``messages[:k]`` is ``HEAD + BODY(m_0) + ... + BODY(m_{k-1}) + TAIL(prompt)``,
so one render of the whole conversation, with the output length noted where each iteration starts and where the
loop ends, gives every prefix's text: :func:`local_shape` adds a marker that writes nothing at those two places, and
:meth:`~packtools.pipeline.tokenizer.chat.render.ChatRenderer.enable_local` renders ``TAIL`` for both prompt values once.
The checks of the incremental rule (each prefix is the start of the next) are made on those texts, with the same
errors.

Whether a template has the shape is decided by its syntax; :mod:`.chat` also compares the spans with the
prefix renders on the built-in adversarial conversations before using them.

>>> t = "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | trim }}{% endfor %}"
>>> local_shape(t + "{% if add_generation_prompt %}<assistant>{% endif %}") is not None
True
>>> local_shape(t.replace("m['role']", "loop.index")) is not None  # the position only
True
>>> local_shape(t.replace("m['role']", "loop.last")) is None  # depends on the messages after it
True
"""

from __future__ import annotations

import functools
from typing import Any

#: Filters that are functions of their arguments alone (no state, no clock, no randomness).
PURE_FILTERS = frozenset(
    {"trim", "lower", "upper", "capitalize", "title", "string", "length", "count", "first", "last", "join",
     "replace", "default", "d", "tojson", "list", "int", "float", "abs", "round", "indent", "safe", "e",
     "escape", "items", "reverse", "wordcount", "center", "truncate", "striptags"}
)  # fmt: skip
#: Tests, likewise.
PURE_TESTS = frozenset(
    {"defined", "undefined", "none", "string", "mapping", "sequence", "iterable", "number", "integer", "float",
     "boolean", "true", "false", "in", "eq", "equalto", "==", "ne", "!=", "lower", "upper", "odd", "even",
     "divisibleby", "sameas", "lt", "le", "gt", "ge", "<", "<=", ">", ">=", "greaterthan", "lessthan"}
)  # fmt: skip
#: Methods a template may call on a message, its values or constants (none mutates or reads outside state).
PURE_METHODS = frozenset(
    {"get", "strip", "lstrip", "rstrip", "split", "rsplit", "startswith", "endswith", "lower", "upper",
     "replace", "items", "keys", "values", "splitlines", "find", "rfind", "count", "title", "capitalize"}
)  # fmt: skip
#: Names no part may read: the conversation as a whole, loop state, and globals with state or a clock.
NEVER = frozenset(
    {"messages", "loop", "self", "caller", "varargs", "kwargs", "namespace", "joiner", "cycler", "lipsum",
     "range", "dict", "strftime_now"}
)  # fmt: skip
#: Loop state the body may read: the message's position, the same in every prefix that holds the message.
LOOP_POSITION = frozenset({"index0", "index", "first"})
MARK = "packtools_iteration_mark"  # the marker's global (only in the instrumented copy)


class _Refused(Exception):
    """The template is outside the shape (the message says where)."""


class _Rules:
    """What one part of the template may do: ``no``, the names it may not read; ``fixed``, the names it may not
    set; ``firsts``, the names of the conversation it may index with ``[0]``; ``loop``, whether it may read the
    loop's position."""

    def __init__(self, no: frozenset[str], fixed: frozenset[str], firsts: frozenset[str], loop: bool) -> None:
        self.no, self.fixed, self.firsts, self.loop = no, fixed, firsts, loop

    def without(self, name: str) -> _Rules:
        return _Rules(self.no - {name}, self.fixed, self.firsts, self.loop)


def _check(node: Any, rules: _Rules) -> None:
    """Raise :class:`_Refused` unless ``node`` and everything under it is on the lists and within ``rules``."""
    from jinja2 import nodes

    kind = type(node)
    if kind is nodes.Name:
        if node.ctx != "load" or node.name in rules.no:
            raise _Refused(f"name {node.name!r}")
        return
    if kind is nodes.Getitem and type(node.node) is nodes.Name and node.node.name in rules.firsts:
        if type(node.arg) is not nodes.Const or type(node.arg.value) is not int or node.arg.value != 0:
            raise _Refused(f"{node.node.name}[...] beyond [0]")
        return
    if kind is nodes.Getattr and type(node.node) is nodes.Name and node.node.name == "loop":
        if not rules.loop or node.attr not in LOOP_POSITION:
            raise _Refused(f"loop.{node.attr}")
        return
    if kind is nodes.Assign:
        if type(node.target) is not nodes.Name or node.target.name in rules.fixed:
            raise _Refused("a {% set %} of a protected name")
        _check(node.node, rules)
        return
    if kind is nodes.Filter and node.name not in PURE_FILTERS:
        raise _Refused(f"filter {node.name!r}")
    if kind is nodes.Test and node.name not in PURE_TESTS:
        raise _Refused(f"test {node.name!r}")
    if kind is nodes.Call:
        callee = node.node
        if not (
            (type(callee) is nodes.Getattr and callee.attr in PURE_METHODS)
            or (type(callee) is nodes.Name and callee.name == "raise_exception")
        ):
            raise _Refused("a call")
        if node.dyn_args is not None or node.dyn_kwargs is not None:
            raise _Refused("a call with *args or **kwargs")
    if kind is nodes.For:
        if node.recursive or type(node.target) is not nodes.Name or node.target.name in rules.fixed:
            raise _Refused("an inner loop")
        _check(node.iter, rules)
        if node.test is not None:
            _check(node.test, rules)
        for child in [*node.body, *node.else_]:
            _check(child, rules.without(node.target.name))
        return
    if kind not in _allowed():
        raise _Refused(f"{kind.__name__} node")
    for child in node.iter_child_nodes():
        _check(child, rules)


def _assigned(nodes_: list[Any]) -> frozenset[str]:
    """The names ``{% set %}`` assigns anywhere under ``nodes_``."""
    from jinja2 import nodes

    found = [n for top in nodes_ for n in [top, *top.find_all(nodes.Assign)] if type(n) is nodes.Assign]
    return frozenset(n.target.name for n in found if type(n.target) is nodes.Name)


@functools.cache
def _allowed() -> frozenset[type]:
    """The syntax-tree node types a template of the shape may hold (filters, tests, calls and loops are then
    checked one by one)."""
    from jinja2 import nodes

    return frozenset(
        {nodes.Output, nodes.If, nodes.TemplateData, nodes.Const, nodes.Name, nodes.Getitem, nodes.Getattr,
         nodes.Slice, nodes.Compare, nodes.Operand, nodes.Test, nodes.Filter, nodes.CondExpr, nodes.And,
         nodes.Or, nodes.Not, nodes.Neg, nodes.Pos, nodes.Concat, nodes.Add, nodes.Sub, nodes.Mul, nodes.Div,
         nodes.FloorDiv, nodes.Mod, nodes.List, nodes.Tuple, nodes.Dict, nodes.Pair, nodes.Keyword,
         nodes.Call, nodes.For, nodes.Assign}
    )  # fmt: skip


def local_shape(template: str, env: Any = None) -> Any:
    """The parsed template with iteration markers added when it has the local shape (module docstring), else
    None.  ``env``: the jinja2 environment to parse with (default: a plain one with transformers' lexer
    settings, ``trim_blocks`` and ``lstrip_blocks``)."""
    from jinja2 import Environment, nodes

    if env is None:
        env = Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    try:
        tree = env.parse(template)
    except Exception:  # noqa: BLE001 - a template this environment cannot parse is not ours to judge
        return None

    def is_alias(n: Any) -> bool:  # {% set loop_messages = messages %}
        return (
            type(n) is nodes.Assign
            and type(n.target) is nodes.Name
            and type(n.node) is nodes.Name
            and n.node.name == "messages"
        )

    aliases = {n.target.name for n in tree.body if is_alias(n)}
    seqs = frozenset({"messages", *aliases})
    loops = [
        i
        for i, n in enumerate(tree.body)
        if type(n) is nodes.For and type(n.iter) is nodes.Name and n.iter.name in seqs
    ]
    if len(loops) != 1 or any(is_alias(n) for n in tree.body[loops[0] :]):
        return None
    at = loops[0]
    loop = tree.body[at]
    if loop.recursive or loop.test is not None or loop.else_ or type(loop.target) is not nodes.Name:
        return None
    target = loop.target.name
    prompt = "add_generation_prompt"
    never = NEVER | seqs
    fixed = never | {target, prompt}  # names no part may set
    head, tail = tree.body[:at], tree.body[at + 1 :]
    head_rules = _Rules(never | {prompt, target}, fixed, seqs, False)
    body_rules = _Rules(never | {prompt}, fixed, seqs, True)
    tail_rules = _Rules(never | {target} | _assigned(head) | _assigned(loop.body), fixed, frozenset(), False)
    try:
        if len(aliases) != sum(map(is_alias, head)):
            raise _Refused("an alias set twice")
        for node in head:
            if not is_alias(node):
                _check(node, head_rules)
        for node in loop.body:
            _check(node, body_rules)
        for node in tail:
            _check(node, tail_rules)
    except _Refused:
        return None
    mark = nodes.Output([nodes.Name(MARK, "load")])
    instrumented = nodes.For(loop.target, loop.iter, [mark, *loop.body], [], None, False)
    body = [*tree.body[:at], instrumented, mark, *tree.body[at + 1 :]]
    return nodes.Template(body).set_environment(env).set_lineno(1)
