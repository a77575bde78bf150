"""Every command the README and docs/ give (``python -m`` one of this repo's tools, or ``python`` one of the scripts
kept beside their records in docs/, in a code block or a code span) parses with today's flags: a reader who reruns
a result's command should not meet "unrecognized arguments". The "Removed" sections record tools and flags that are
gone, so their commands are not checked; the docs' ``python -c`` one-liners run on the kept files."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.doc_text import DOCS, ROOT, records_removals, sections

COMMAND = re.compile(r"python (?:-m )?((?:gpt2_bench|tagc|testbed)[\w.]*|docs/[\w/]+\.py)([^&|;>#\n]*)")
FENCE = re.compile(r"```[\w-]*\n(.*?)```", flags=re.S)
SPAN = re.compile(r"`([^`]+)`")
ELIDED = ("...", "$", "<", "[")
"""A command with one of these is a pattern (``--methods ...``, ``$b``, ``<run>``, ``[--flat]``), not one to run."""


def doc_commands() -> list[tuple[str, str, str, list[str]]]:
    """``(doc, section, module, arguments)`` for every command in the docs, sections by their ``##`` heading."""
    found = []
    for doc in DOCS:
        for section, chunk in sections(doc):
            blocks = [re.sub(r"\\\n\s*", " ", block) for block in FENCE.findall(chunk)]
            spans = [span.replace("\n", " ") for span in SPAN.findall(FENCE.sub("", chunk))]
            for text in (*blocks, *spans):
                for match in COMMAND.finditer(text):
                    found.append((doc.name, section, match.group(1), match.group(2).strip()))
    return [(doc, section, module, shlex.split(args)) for doc, section, module, args in found
            if not any(mark in args for mark in ELIDED) and not records_removals(section)]


COMMANDS = doc_commands()


def exists(module: str) -> bool:
    if module.endswith(".py"):
        return (ROOT / module).is_file()
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


class Parsed(Exception):
    """Raised right after the command line parsed, so that nothing runs."""


def load(module: str):
    """The module whose ``main`` the command runs: a script by its path, a package's ``__main__``, or the module."""
    if module.endswith(".py"):
        spec = importlib.util.spec_from_file_location(Path(module).stem, ROOT / module)
        script = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(script)
        return script
    return importlib.import_module(f"{module}.__main__" if importlib.util.find_spec(module).submodule_search_locations
                                   else module)


def parse_only(monkeypatch: pytest.MonkeyPatch, module: str, argv: list[str]) -> None:
    """Call ``module``'s ``main`` on ``argv`` (a script's reads ``sys.argv``) and stop at its first parse."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        original(self, args, namespace)
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "argv", [module, *argv])
    main = load(module).main
    with pytest.raises(Parsed):
        main(argv) if inspect.signature(main).parameters else main()


def test_the_docs_give_commands():
    modules = {module for _, _, module, args in COMMANDS if args}
    assert {"gpt2_bench.compare", "gpt2_bench.evidence", "gpt2_bench.train", "tagc.bench"} <= modules, modules


@pytest.mark.parametrize("doc, section, module, argv", [c for c in COMMANDS if not c[3]],
                         ids=lambda value: value if isinstance(value, str) and "." in value else None)
def test_a_named_tool_exists(doc, section, module, argv):
    assert exists(module), f"{doc} ({section}) names python -m {module}, which is gone"


@pytest.mark.parametrize("doc, section, module, argv", [c for c in COMMANDS if c[3]],
                         ids=lambda value: value if isinstance(value, str) and "." in value else None)
def test_a_documented_command_parses(monkeypatch, capsys, doc, section, module, argv):
    assert exists(module), f"{doc} ({section}) gives python -m {module}, which is gone"
    try:
        parse_only(monkeypatch, module, argv)
    except SystemExit as stop:
        pytest.fail(f"{doc} ({section}): python -m {module} {shlex.join(argv)}: {capsys.readouterr().err.strip()} "
                    f"(exit {stop.code})")


ONE_LINERS = [(doc.name, line.strip()) for doc in DOCS for block in FENCE.findall(doc.read_text())
              for line in block.splitlines() if line.strip().startswith("python -c ")]
"""The docs' ``python -c`` commands that recompute a table from kept files."""


@pytest.mark.parametrize("doc, line", ONE_LINERS, ids=lambda value: value if value.endswith(".md") else None)
def test_a_documented_one_liner_runs_on_the_kept_files(doc, line):
    done = subprocess.run([sys.executable, "-c", shlex.split(line)[2]], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and done.stdout.strip(), f"{doc}: {line[:80]}...: {done.stderr.strip()[-300:]}"


def test_the_docs_give_one_liners():
    assert len(ONE_LINERS) >= 2
