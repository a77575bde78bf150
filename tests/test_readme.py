"""The README answers in one screen: what TAGC does, which codec, install, the one line, the two commands."""

import re
from pathlib import Path

README = (Path(__file__).resolve().parent.parent / "README.md").read_text().splitlines()


def _prose(lines: list[str]) -> str:
    """``lines`` without code blocks, code spans, links' targets and HTML comments."""
    text, fenced = [], False
    for line in lines:
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            text.append(re.sub(r"`[^`]*`|\]\([^)]*\)|<!--.*?-->", " ", line))
    return "\n".join(text)


def test_the_first_screen_holds_the_five_answers():
    screen = "\n".join(README[:40])
    for needed in ("## Which codec to use", "hook = tagc.hook()", "tagc.register_comm_hook(model, hook)",
                   "pip install", "python -m gpt2_bench.compare", "<!-- test-command -->", "python -m pytest"):
        assert needed in screen, needed
    code = screen[screen.index("```python"):]
    assert code.index("hook = tagc.hook()") < code.index("hook.follow_lr")  # the snippet defines what it uses


def _codec_table() -> list[list[str]]:
    """The cells of each body row of the "Which codec to use" table."""
    start = README.index("## Which codec to use")
    table = []
    for line in README[start + 1:]:
        if not line.startswith("|"):
            if table:
                break
            continue
        table.append(line)
    return [line.strip("|").split("|") for line in table[2:]]


def test_the_one_line_is_a_call_the_table_picks():
    """The snippet's live call (not a comment) is a pick of the table whose evidence does not say it trails plain,
    so the README never shows first a setting its evidence does not hold."""
    screen = README[:40]
    start = screen.index("```python")
    live = [line.split("#")[0].strip() for line in screen[start + 1:screen.index("```", start + 1)]]
    call = next(line.removeprefix("hook = ") for line in live if line.startswith("hook = "))
    evidence = [cells[2] for cells in _codec_table() if cells[1].strip().startswith(f"`{call}`")]
    assert evidence and "behind" not in evidence[0], (call, evidence)


def test_which_codec_table_is_short():
    body = _codec_table()
    assert 1 <= len(body) <= 6
    for cells in body:
        for cell in cells:
            assert len(cell.split()) <= 15, cell


def test_few_numbers_and_no_dates_up_front():
    prose = _prose(README[:60])
    numbers = re.findall(r"(?<![\w.])\d[\d,.]*", prose)
    assert len(numbers) <= 12, numbers
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", "\n".join(README)), "dated text belongs in docs/"
