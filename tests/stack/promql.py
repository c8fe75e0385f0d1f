"""Just enough PromQL to say which series an expression reads, and by which labels.

A tokenizer, not a parser: it finds the vector selectors (``name{label="v"}`` with an
optional ``[range]``), the label lists of ``by``/``without``/``on``/``ignoring``/
``group_left``/``group_right``, and leaves the syntax itself to ``promtool``. It knows
the grammar's corners that matter here: strings may hold anything, ``{...}`` holds label
matchers, a name followed by ``(`` is a function or an aggregation, and ``$var`` or
``$__rate_interval`` are Grafana's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_TOKEN = re.compile(
    r"""
    (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
  | (?P<range>\[[^\]]*\])
  | (?P<var>\$\{?\w+\}?)
  | (?P<number>(?:0[xX][0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+)[a-zA-Z]*)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>=~|!~|!=|==|<=|>=|[{}()\[\],=<>+\-*/%^@])
  | (?P<space>\s+)
  | (?P<comment>\#[^\n]*)
    """,
    re.VERBOSE,
)
_LABEL_LISTS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_KEYWORDS = _LABEL_LISTS | {"bool", "and", "or", "unless", "offset", "inf", "nan"}
_MATCH_OPS = {"=", "!=", "=~", "!~"}
_AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count"}
_PARAMETRIC_AGGREGATIONS = {"count_values", "topk", "bottomk", "quantile", "limitk", "limit_ratio"}


@dataclass
class Selector:
    """One vector selector: its metric name, the labels its matchers name, and whether it has a range."""

    name: str
    labels: set[str] = field(default_factory=set)
    ranged: bool = False


@dataclass
class Query:
    """What an expression reads."""

    selectors: list[Selector]
    grouping: set[str]  # every label named in by/without/on/ignoring/group_* lists
    functions: set[str]


def tokens(expr: str) -> list[tuple[str, str]]:
    """``(kind, text)`` pairs, without spaces and comments; raises ``ValueError`` on a stray character."""
    out: list[tuple[str, str]] = []
    position = 0
    while position < len(expr):
        match = _TOKEN.match(expr, position)
        if match is None:
            raise ValueError(f"cannot read {expr[position : position + 20]!r} in {expr!r}")
        position = match.end()
        kind = match.lastgroup or ""
        if kind not in ("space", "comment"):
            out.append((kind, match.group()))
    return out


def _label_list(toks: list[tuple[str, str]], start: int) -> tuple[set[str], int]:
    """The identifiers in the parenthesised list at ``start`` and the index after it."""
    assert toks[start][1] == "(", toks[start:]
    labels: set[str] = set()
    index = start + 1
    while toks[index][1] != ")":
        if toks[index][0] == "ident":
            labels.add(toks[index][1])
        index += 1
    return labels, index + 1


def _matchers(toks: list[tuple[str, str]], start: int) -> tuple[set[str], str | None, int]:
    """The label names in the ``{...}`` at ``start``, a ``__name__="x"`` name, and the index after it."""
    labels: set[str] = set()
    name: str | None = None
    index = start + 1
    while toks[index][1] != "}":
        kind, text = toks[index]
        if kind == "ident" and toks[index + 1][1] in _MATCH_OPS:
            operator, value = toks[index + 1][1], toks[index + 2][1]
            if text == "__name__" and operator == "=":
                name = value[1:-1]
            else:
                labels.add(text)
            index += 3
            continue
        index += 1
    return labels, name, index + 1


def parse(expr: str) -> Query:
    """The selectors, grouping labels and functions of ``expr``."""
    toks = [*tokens(expr), ("end", "")]
    selectors: list[Selector] = []
    grouping: set[str] = set()
    functions: set[str] = set()
    index = 0
    while toks[index][0] != "end":
        kind, text = toks[index]
        following = toks[index + 1][1]
        if kind == "ident" and text.lower() in _KEYWORDS:
            if text in _LABEL_LISTS and following == "(":
                labels, index = _label_list(toks, index + 1)
                grouping |= labels
            else:
                index += 1
            continue
        if kind == "ident" and (following == "(" or text in _AGGREGATIONS | _PARAMETRIC_AGGREGATIONS):
            functions.add(text)
            index += 1
            continue
        if kind == "ident" or (kind == "op" and text == "{"):
            selector = Selector(text if kind == "ident" else "")
            index += 1 if kind == "ident" else 0
            if toks[index][1] == "{":
                labels, name, index = _matchers(toks, index)
                selector.labels = labels
                selector.name = selector.name or name or ""
            if toks[index][0] == "range":
                selector.ranged = True
                index += 1
            selectors.append(selector)
            continue
        index += 1
    return Query(selectors, grouping, functions)
