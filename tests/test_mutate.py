"""tests/mutate.py's choice of what to mutate: message text is skipped, logic is not."""

import textwrap

import pytest

from mutate import annotation_spans, changed_lines, line_span, message_spans, skip_reason

SOURCE = textwrap.dedent('''\
    def f(t, x: int | None, used) -> float | None:
        if x > 3 and used < 2:
            t.log(f"x {x / 3600:.3f} h and {used + 1} left")
            raise ValueError(f"x={x}: more than " + str(3 * 2))
        print("n", x * 2)
        y = x + 1  # pragma: no mutate
        return y - 1
    ''')


def _reason(line, start_col, end_col):
    return skip_reason(SOURCE.splitlines(), message_spans(SOURCE), (line, start_col), (line, end_col))


def test_message_text_and_pragma_lines_are_skipped_and_logic_is_not():
    assert _reason(2, 7, 8) is None and _reason(2, 9, 10) is None  # x > 3: the condition is behaviour
    assert _reason(2, 15, 24) is None  # the `and`
    assert _reason(3, 21, 22) == "message"  # the / inside the f-string
    assert _reason(3, 41, 42) == "message"  # used + 1, inside it too
    assert _reason(4, 53, 54) == "message"  # 3 * 2 in the error's message
    assert _reason(5, 17, 18) == "message"  # print's arguments
    assert _reason(6, 10, 11) == "pragma"
    assert _reason(7, 13, 14) is None  # y - 1


def test_annotations_are_skipped():
    lines, notes = SOURCE.splitlines(), annotation_spans(SOURCE)
    bar = lines[0].index("|")
    assert skip_reason(lines, message_spans(SOURCE), (1, bar), (1, bar + 1), notes) == "annotation"
    ret = lines[0].rindex("|")
    assert skip_reason(lines, message_spans(SOURCE), (1, ret), (1, ret + 1), notes) == "annotation"
    assert skip_reason(lines, message_spans(SOURCE), (2, 9), (2, 10), notes) is None  # x > 3


def test_the_raise_itself_stays_mutable():
    spans = message_spans(SOURCE)
    raise_line = SOURCE.splitlines()[3]
    start = raise_line.index("ValueError")
    assert skip_reason(SOURCE.splitlines(), spans, (4, start), (4, start + len("ValueError"))) is None


def test_since_a_revision_only_the_lines_a_change_touched_are_mutated():
    diff = textwrap.dedent('''\
        diff --git a/experiment/m.py b/experiment/m.py
        --- a/experiment/m.py
        +++ b/experiment/m.py
        @@ -3 +3 @@ def f():
        -    return 1
        +    return 2
        @@ -10,0 +11,3 @@ def g():
        +    a = 1
        +    b = 2
        +    c = 3
        @@ -20,2 +23,0 @@ def h():
        -    gone = 1
        -    gone = 2
        ''')
    assert changed_lines(diff) == {3, 11, 12, 13}  # a deletion leaves no new line to mutate


def test_lines_name_one_stretch_of_a_module_both_ends_included():
    assert line_span("511-513") == {511, 512, 513}
    assert line_span("7-7") == {7}
    for bad in ("513-511", "0-3", "5", "a-b", "5-", "-5", "1-2-3"):
        with pytest.raises(ValueError, match=f"--lines {bad}: expected A-B"):
            line_span(bad)
