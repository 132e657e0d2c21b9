"""`fleetrl config --list`: every config field with its default and its doc, as a TOML file one can start from.

`python -m deploy.config_list --markdown` renders the same listing as docs/configuration.md, so that page
cannot drift from the code: tests/unit/test_docs.py fails when the file differs from what this prints.

The docs are the comments in protocol/config/, read from the source of the module that defines each section's
class: the comment after a field, or the comment lines right above it (a field whose doc takes several lines;
also any doc too long for one line, which ruff format would otherwise wrap into parentheses where this listing
no longer finds it). The defaults come from the dataclasses themselves, so the listing is the config the code
runs, and tests/unit/test_cli.py checks every field has a doc.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import re
import sys
import tokenize
from dataclasses import dataclass
from functools import cache
from typing import Any, get_type_hints

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


@cache
def _module_source(name: str) -> tuple[ast.Module, dict[int, str], list[str]]:
    """A module's syntax tree, its comments by line, and its lines."""
    source = inspect.getsource(sys.modules[name])
    return ast.parse(source), _comments(source), source.splitlines()


def _field_docs(cls: type) -> dict[str, list[str]]:
    """Field name -> its doc lines, from the source of the module that defines `cls`."""
    tree, comments, lines = _module_source(cls.__module__)
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
    out = []
    for section, cls in sections():
        docs = _field_docs(cls)
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


MARKDOWN_COMMAND = "python -m deploy.config_list --markdown > docs/configuration.md"

_MARKDOWN_INTRO = f"""\
<!-- Generated from protocol/config/ by `{MARKDOWN_COMMAND}`. Do not edit by hand:
     tests/unit/test_docs.py fails when this file differs from what that command prints. -->

# Configuration

A run has one typed config: a TOML file, plus `section.field=value` overrides on the command line. The
learner and the actors read the same file. A bad value fails at start with one line that names the field,
e.g. `fleetrl: config error: train.lr: must be > 0`.

- `fleetrl config --list [PREFIX]` prints every field below as a TOML file to start from (`PREFIX`, e.g.
  `log` or `train.lr`, keeps the fields whose dotted name starts so).
- `fleetrl config CONFIG [section.field=value ...]` prints a config resolved: the file, the overrides and
  the defaults.
- `fleetrl plan CONFIG` checks the batch arithmetic and the memory per GPU ([recipes.md](recipes.md)).
- [`configs/demo.toml`](../configs/demo.toml) spells out the demo; `configs/` holds the recipes.

**Updates and optimizer steps.** An *update* trains one rollout batch (`train.prompts_per_step` prompts x
`rollout.samples_per_prompt` completions) in S = `train.mini_batches` x `train.ppo_epochs` *optimizer steps*.
The policy version and `train.warmup_steps` count optimizer steps; `train.total_steps`, `eval.every_steps`,
`checkpoint.every_steps` and `log.samples_every_steps` count updates.

This page is the listing of `protocol/config/`: the defaults are the dataclasses' own, and each doc is the
comment beside (or above) the field in the module named under its section, whose `__post_init__` checks it.
A field whose doc lists its choices takes only those (`Literal[...]` in the code).
"""


def _md_escape(text: str) -> str:
    """Text for a table cell or a paragraph: `|` always escaped (GFM splits cells on it even inside code
    spans); outside code spans `<` (or `</answer>` would vanish as an HTML tag) and `*` (emphasis)."""
    parts = text.split("`")
    for i, part in enumerate(parts):
        if i % 2 == 0:  # outside a code span
            part = part.replace("<", "&lt;").replace("*", "\\*")
        parts[i] = part.replace("|", "\\|")
    return "`".join(parts)


def _md_doc(lines: list[str]) -> str:
    """A field's comment lines as one table cell: a line opening a list item starts a new line (<br>)."""
    out = ""
    for line in lines:
        text = line.strip()
        if out and re.match(r"[-*] ", text):
            out += "\0"  # a mark that escaping leaves alone, for the <br> it would escape
        elif out:
            out += " "
        out += text
    return _md_escape(out).replace("\0", "<br>")


def render_markdown() -> str:
    """The listing as the Markdown page docs/configuration.md: one table per section, in Config's order."""
    fields = field_docs()
    classes = dict(sections())
    names = list(dict.fromkeys(f.section for f in fields))
    out = [_MARKDOWN_INTRO, "Sections: " + " · ".join(f"[{name}](#{name})" for name in names), ""]
    for section in names:
        source = classes[section].__module__.replace(".", "/") + ".py"
        out += [f"## {section}", "", f"Defined in [`{source}`](../{source}).", ""]
        doc = inspect.cleandoc(classes[section].__doc__ or "")
        if doc and not doc.startswith(classes[section].__name__ + "("):
            out += [_md_escape(" ".join(doc.split())), ""]
        out += ["| field | default | meaning |", "|---|---|---|"]
        for f in (f for f in fields if f.section == section):
            default = _md_escape(f"`{toml_value(f.default)}`")
            out.append(f"| `{f.section}.{f.name}` | {default} | {_md_doc(f.doc)} |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.config_list", description="every config field with its default and its doc")
    parser.add_argument("prefix", nargs="?", default="", help="only fields whose dotted name starts so (TOML only)")
    parser.add_argument("--markdown", action="store_true", help="the page docs/configuration.md instead of TOML")
    args = parser.parse_args(argv)
    if args.markdown and args.prefix:
        parser.error("--markdown renders every field: no PREFIX")
    sys.stdout.write(render_markdown() if args.markdown else render(args.prefix))
    return 0


if __name__ == "__main__":
    sys.exit(main())
