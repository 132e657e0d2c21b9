"""`fleetrl config --list`: every config field with its default and its doc, as a TOML file one can start from.

The docs are the comments in protocol/config.py, read from its source: the comment after a field, or the comment
lines right above it (a field whose doc takes several lines). The defaults come from the dataclasses themselves,
so the listing is the config the code runs, and tests/test_cli_commands.py checks every field has a doc.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import tokenize
from dataclasses import dataclass
from typing import Any, get_type_hints

from protocol import config as config_module
from protocol.config import Config, toml_value


@dataclass(frozen=True, slots=True)
class FieldDoc:
    section: str
    name: str
    default: Any
    doc: list[str]  # the comment's lines, without '#' (usually one)


def _comments(source: str) -> dict[int, str]:
    """Line number -> the text of the comment on that line (tokenize knows a '#' inside a string is no comment)."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string[1:]
            out[tok.start[0]] = (text[1:] if text.startswith(" ") else text).rstrip()  # keeps a list's indents
    return out


def _field_docs(cls: type, tree: ast.Module, comments: dict[int, str], lines: list[str]) -> dict[str, list[str]]:
    (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__]
    docs: dict[str, list[str]] = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        end = stmt.end_lineno or stmt.lineno
        if end in comments:  # the comment beside the field
            docs[stmt.target.id] = [comments[end]]
            continue
        above: list[str] = []  # else the comment lines right above it
        line = stmt.lineno - 1
        while line in comments and lines[line - 1].lstrip().startswith("#"):
            above.insert(0, comments[line])
            line -= 1
        docs[stmt.target.id] = above
    return docs


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    assert f.default_factory is not dataclasses.MISSING, f"{f.name} has no default"
    return f.default_factory()


def sections() -> list[tuple[str, type]]:
    """(section name, its dataclass) in Config's order."""
    hints = get_type_hints(Config)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(Config)]


def field_docs() -> list[FieldDoc]:
    source = inspect.getsource(config_module)
    tree, comments, lines = ast.parse(source), _comments(source), source.splitlines()
    out = []
    for section, cls in sections():
        docs = _field_docs(cls, tree, comments, lines)
        out += [FieldDoc(section, f.name, _default(f), docs.get(f.name, [])) for f in dataclasses.fields(cls)]
    return out


def render(prefix: str = "") -> str:
    """The listing as TOML (loadable: it is the default config). `prefix`: only fields whose dotted name starts so."""
    fields = [f for f in field_docs() if f"{f.section}.{f.name}".startswith(prefix)]
    classes = dict(sections())
    out: list[str] = []
    for section in dict.fromkeys(f.section for f in fields):
        out.append(f"[{section}]")
        doc = inspect.cleandoc(classes[section].__doc__ or "")
        if doc and not doc.startswith(classes[section].__name__ + "("):  # dataclasses invent one from the signature
            out += [f"# {line}" for line in doc.splitlines()]
        for f in (f for f in fields if f.section == section):
            value = f"{f.name} = {toml_value(f.default)}"
            if len(f.doc) == 1:
                out.append(f"{value}  # {f.doc[0]}")
            else:
                out += [f"# {line}" for line in f.doc] + [value]
        out.append("")
    return "\n".join(out)
