"""The docs keep up with the code: links resolve, `planner` commands and their options exist, option tables are whole.

Checked in README.md, docs/*.md and notebooks/*.md, statically (no subprocess, no torch imported here):

1. every relative link (and its #anchor, for Markdown targets) resolves;
2. every `planner COMMAND ... --option` in a code block or inline code names a command of the typer
   app and options of that command (`./dev.sh demo` runs `planner profile`; `planner train` and
   `-m runtime.train` also take the options of runtime/train.py's parser, read from its source);
3. a table of options preceded by `<!-- options-of: planner COMMAND -->` lists exactly the
   command's options (without --help), and `planner partition` has one; every table whose
   first column is headed `option` carries such a marker;
4. repository paths (`planner/...py`, `tests/...`) and dotted names (`planner.files.plan`,
   `runtime.Engine`) written in code exist.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import typer

from planner.cli import app

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "notebooks").glob("*.md")])

# commands that pass the options they do not know on to another parser: command -> that parser's source
FORWARDED = {"train": REPO / "runtime" / "train.py"}
DEV_SH = {"demo": "profile"}  # ./dev.sh demo ARGS runs `planner profile examples/gpt.py ARGS`
MARKER = re.compile(r"<!--\s*options-of:\s*planner\s+([\w-]+)\s*-->")
REQUIRED_TABLES = ("partition",)

INVOCATION = re.compile(r"(?<![\w.-])(planner|dev\.sh|-m[ \t]+runtime\.train)\b(?:[ \t]+([a-z][\w-]*))?")
END_OF_INVOCATION = re.compile(r"`|\s#|\||;|&|\)")  # a comment, pipe, command separator or closing parenthesis
OPTION = re.compile(r"(?<![\w-])(--[A-Za-z][\w-]*|-[A-Za-z](?![\w-]))")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.DOTALL)
REPO_PATH = re.compile(
    r"(?<![\w./-])((?:planner|runtime|tests|benchmarks|examples|notebooks|docs)/[\w./-]*\.(?:py|md|ipynb|png|toml))\b"
)
DOTTED = re.compile(r"(?<![\w./-])((?:planner|runtime)(?:\.[A-Za-z_]\w*)+)")


@dataclass(frozen=True)
class Doc:
    path: Path
    code: tuple[tuple[int, str], ...]  # (line, text): code-block lines (continuations joined) and inline code spans
    prose: tuple[tuple[int, str], ...]  # (line, text) outside code blocks, inline code left in
    headings: tuple[str, ...]

    @property
    def name(self) -> str:
        return str(self.path.relative_to(REPO)) if self.path.is_relative_to(REPO) else str(self.path)


@cache
def read_doc(path: Path) -> Doc:
    code: list[tuple[int, str]] = []
    prose: list[tuple[int, str]] = []
    headings: list[str] = []
    fence: str | None = None
    pending, first = "", 0
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        stripped = line.strip()
        if fence is None and stripped.startswith(("```", "~~~")):
            fence = stripped[:3]
        elif fence is not None and stripped.startswith(fence):
            fence = None
        elif fence is not None:
            first = first if pending else number
            pending += line
            if line.endswith("\\"):  # a shell continuation: one command over several lines
                pending = pending[:-1] + " "
            else:
                code.append((first, pending))
                pending = ""
        else:
            prose.append((number, line))
            if re.match(r"#{1,6}\s", line):
                headings.append(line.lstrip("#").strip())
    # inline code spans may wrap lines: search the prose as one text, keep each span's first line number
    text = "\n".join(line for _, line in prose)
    starts = [number for number, _ in prose]
    for match in INLINE_CODE.finditer(text):
        line = starts[text.count("\n", 0, match.start())]
        code.append((line, " ".join(match.group(2).split())))
    return Doc(path, tuple(code), tuple(prose), tuple(headings))


def slugs(headings: tuple[str, ...]) -> set[str]:
    """GitHub's anchors of the headings: lower case, punctuation dropped, spaces as hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    result = set()
    for heading in headings:
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return result


@cache
def commands() -> dict[str, Any]:
    """The app's click commands by name (typer's own copy of click: typed loosely)."""
    return dict(typer.main.get_command(app).commands)


def click_options(command: Any) -> set[str]:
    """Every spelling of every option of `command`, --help included."""
    names = {"--help"}
    for param in command.params:
        if param.param_type_name == "option":
            names.update(param.opts)
            names.update(param.secondary_opts)
    return names


def passes_unknown_options_on(command: Any) -> bool:
    return bool(command.ignore_unknown_options or (command.context_settings or {}).get("ignore_unknown_options"))


@cache
def argparse_options(source: Path) -> frozenset[str]:
    """The option strings of every `parser.add_argument(...)` in `source`, plus -h/--help; read without importing it."""
    names = {"-h", "--help"}
    for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            names.update(arg.value for arg in node.args
                         if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("-"))
    return frozenset(names)


def allowed_options(command_name: str) -> set[str]:
    names = click_options(commands()[command_name])
    if command_name in FORWARDED:
        names |= argparse_options(FORWARDED[command_name])
    return names


def invocations(text: str) -> list[tuple[str, str | None, str]]:
    """(program, command, arguments) of each `planner CMD ...`, `dev.sh CMD ...` or `-m runtime.train ...` in text."""
    found = list(INVOCATION.finditer(text))
    result = []
    for index, match in enumerate(found):
        stop = found[index + 1].start() if index + 1 < len(found) else len(text)
        arguments = END_OF_INVOCATION.split(text[match.end():stop], maxsplit=1)[0]
        program = "runtime.train" if match.group(1).startswith("-m") else match.group(1)
        result.append((program, match.group(2), arguments))
    return result


def command_problems(doc: Doc) -> list[str]:
    problems = []
    for line, text in doc.code:
        for program, command, arguments in invocations(text):
            if program == "runtime.train":
                # `-m runtime.train FILE --opt`: the word after it is the model file, not a command
                arguments = f"{command or ''} {arguments}"
                allowed = set(argparse_options(FORWARDED["train"]))
                label = "python -m runtime.train"
            elif program == "dev.sh":
                if command not in DEV_SH:
                    continue  # ./dev.sh test takes pytest's options
                allowed, label = allowed_options(DEV_SH[command]), f"./dev.sh {command}"
            else:
                if command is None:
                    continue  # `planner` alone, `planner --help`
                if command not in commands():
                    problems.append(f"{doc.name}:{line}: `planner {command}` is not a command "
                                    f"(commands: {', '.join(sorted(commands()))}): {text!r}")
                    continue
                allowed, label = allowed_options(command), f"planner {command}"
            for option in OPTION.findall(arguments):
                if option not in allowed:
                    problems.append(f"{doc.name}:{line}: `{label}` has no option {option}: {text!r}")
    return problems


def without_inline_code(doc: Doc) -> list[tuple[int, str]]:
    """The prose lines with inline code spans (which may wrap lines) blanked out, line numbers kept."""
    text = INLINE_CODE.sub(lambda match: "code" + "\n" * match.group(0).count("\n"), "\n".join(t for _, t in doc.prose))
    return list(zip((number for number, _ in doc.prose), text.split("\n")))


def link_problems(doc: Doc) -> list[str]:
    problems = []
    for line, text in without_inline_code(doc):
        for target in LINK.findall(text):
            if re.match(r"[a-z][\w+.-]*:", target):  # https:, mailto:, ...
                continue
            file_part, _, anchor = target.partition("#")
            resolved = (doc.path.parent / file_part).resolve() if file_part else doc.path
            if not resolved.exists():
                problems.append(f"{doc.name}:{line}: link to {target}: {resolved} does not exist")
            elif anchor and resolved.suffix == ".md" and anchor not in slugs(read_doc(resolved).headings):
                problems.append(f"{doc.name}:{line}: link to {target}: no heading #{anchor} in {file_part or doc.name}")
    return problems


def option_tables(doc: Doc) -> tuple[list[tuple[int, str, list[str]]], list[str]]:
    """The marked option tables of doc as (line, command, first cells), and problems with unmarked ones."""
    tables, problems = [], []
    lines = list(doc.prose)
    index = 0
    while index < len(lines):
        number, text = lines[index]
        marker = MARKER.search(text)
        is_table = text.lstrip().startswith("|")
        if not marker and not is_table:
            index += 1
            continue
        if marker:  # the table follows the marker, blank lines allowed
            index += 1
            while index < len(lines) and not lines[index][1].strip():
                index += 1
        rows = []
        while index < len(lines) and lines[index][1].lstrip().startswith("|"):
            rows.append(re.split(r"(?<!\\)\|", lines[index][1].strip())[1].strip())
            index += 1
        header, body = (rows[0], rows[2:]) if len(rows) > 2 else ("", [])
        if marker:
            if not body:
                problems.append(f"{doc.name}:{number}: {marker.group(0)} is not followed by a table")
            else:
                tables.append((number, marker.group(1), body))
        elif header.lower() == "option":
            problems.append(f"{doc.name}:{number}: a table of options without a <!-- options-of: planner COMMAND --> "
                            "line before it (the test then checks it against the command)")
    return tables, problems


def table_problems(doc: Doc) -> list[str]:
    tables, problems = option_tables(doc)
    for line, command, cells in tables:
        if command not in commands():
            problems.append(f"{doc.name}:{line}: options-of names no command: planner {command}")
            continue
        allowed = allowed_options(command)
        written = {option for cell in cells for option in OPTION.findall(cell)}
        for option in sorted(written - allowed):
            problems.append(f"{doc.name}:{line}: the table of `planner {command}` lists {option}, "
                            "which the command does not have")
        for option in sorted({o for o in allowed if o.startswith("--")} - {"--help"} - written):
            problems.append(f"{doc.name}:{line}: the table of `planner {command}` lacks its option {option}")
    return problems


@cache
def module_names(path: Path) -> frozenset[str]:
    """Names a module defines or imports at its top level (in `if`/`try` blocks too: `if TYPE_CHECKING:`), and,
    when it answers names lazily with a module `__getattr__`, the string keys of its top-level dict literals."""
    names: set[str] = set()
    lazy: set[str] = set()
    statements = list(ast.parse(path.read_text(encoding="utf-8")).body)
    while statements:
        node = statements.pop()
        if isinstance(node, (ast.If, ast.Try)):
            statements.extend([*node.body, *node.orelse, *getattr(node, "finalbody", [])])
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            literals = node.value.keys if isinstance(node.value, ast.Dict) else getattr(node.value, "elts", [])
            lazy.update(e.value for e in literals if isinstance(e, ast.Constant) and isinstance(e.value, str))
    return frozenset(names | lazy) if "__getattr__" in names else frozenset(names)


def dotted_problem(name: str) -> str | None:
    """Why `planner.x.y` (or `runtime.x`) names nothing: its modules are found as files, then one attribute."""
    parts = name.split(".")
    path = REPO / parts[0]
    for index, part in enumerate(parts[1:], 1):
        if path.is_dir() and (path / part / "__init__.py").is_file():
            path = path / part
        elif path.is_dir() and (path / f"{part}.py").is_file():
            path = path / f"{part}.py"
        else:
            module = path / "__init__.py" if path.is_dir() else path
            if part in module_names(module):
                return None  # an attribute of the module; what follows is an attribute of it
            return f"{'.'.join(parts[:index])} has no module or name {part}"
    return None


def code_reference_problems(doc: Doc) -> list[str]:
    problems = []
    for line, text in doc.code:
        for path in REPO_PATH.findall(text):
            if not (REPO / path).exists():
                problems.append(f"{doc.name}:{line}: {path} does not exist")
        for name in DOTTED.findall(text):
            problem = dotted_problem(name)
            if problem:
                problems.append(f"{doc.name}:{line}: {name}: {problem}")
    return problems


def ids(paths: list[Path]) -> list[str]:
    return [str(path.relative_to(REPO)) for path in paths]


@pytest.mark.parametrize("path", DOCS, ids=ids(DOCS))
def test_relative_links_resolve(path: Path) -> None:
    problems = link_problems(read_doc(path))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", DOCS, ids=ids(DOCS))
def test_planner_commands_and_options_exist(path: Path) -> None:
    problems = command_problems(read_doc(path))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", DOCS, ids=ids(DOCS))
def test_option_tables_match_the_cli(path: Path) -> None:
    problems = table_problems(read_doc(path))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", DOCS, ids=ids(DOCS))
def test_paths_and_module_names_in_code_exist(path: Path) -> None:
    problems = code_reference_problems(read_doc(path))
    assert not problems, "\n".join(problems)


def test_the_partition_options_are_documented_in_a_table() -> None:
    documented = {command for path in DOCS for _, command, _ in option_tables(read_doc(path))[0]}
    assert set(REQUIRED_TABLES) <= documented, f"no options-of table for: {set(REQUIRED_TABLES) - documented}"


def test_the_forwarding_commands_are_known() -> None:
    """A command that passes unknown options on needs the parser it passes them to, to check its options."""
    forwarding = {name for name, command in commands().items() if passes_unknown_options_on(command)}
    assert forwarding == set(FORWARDED)
    assert all(source.is_file() for source in FORWARDED.values())


def test_the_checks_find_what_they_look_for(tmp_path: Path) -> None:
    """The parsing itself: wrapped inline code, continuations, comments, forwarded options, tables, anchors."""
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n## The planner's cost model\n\n"
        "Run `planner partition p.json --gpus 2\n--nonsense` and [this](#the-planners-cost-model) "
        "and [that](#nowhere) and [gone](missing.md) and [web](https://example.org); `planner/plots.py` moved.\n\n"
        "```\nplanner show plan.json --scaling   # --not-checked\n"
        "planner train m.py --plan p.json \\\n    --steps 3 --bogus\n"
        "torchrun --nproc-per-node 2 -m runtime.train m.py --plan p.json --resume --nproc 2\n"
        "planner frobnicate x\n```\n\n"
        "<!-- options-of: planner inspect -->\n"
        "| option | meaning |\n|---|---|\n| `--debug` | x |\n| `--out`, `-o` | y |\n\n"
        "| option | meaning |\n|---|---|\n| `--x` | unmarked |\n",
        encoding="utf-8",
    )
    doc = read_doc(page)
    commands_found = "\n".join(command_problems(doc))
    assert "`planner partition` has no option --nonsense" in commands_found
    assert "`planner show`" not in commands_found
    assert "page.md:10: `planner train` has no option --bogus" in commands_found
    assert "no option --steps" not in commands_found and "no option --scaling" not in commands_found
    assert "`python -m runtime.train` has no option --nproc" in commands_found
    assert "`planner frobnicate` is not a command" in commands_found
    links = "\n".join(link_problems(doc))
    assert "#nowhere" in links and "missing.md" in links
    assert "the-planners-cost-model" not in links and "example.org" not in links
    tables = "\n".join(table_problems(doc))
    assert "lists --out" in tables and "lists -o" in tables and "without a <!-- options-of" in tables
    assert "planner/plots.py does not exist" in "\n".join(code_reference_problems(doc))
    assert dotted_problem("planner.files.plan.load_plan") is None
    assert dotted_problem("planner.plan") is not None
