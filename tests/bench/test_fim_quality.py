"""The completion-quality benchmark's cases: the removed statement is nowhere in the prompt, and the
shifted variants start from the document as it was before the last keystroke or line."""
from llmd.bench.fim_quality import Case, file_cases, typed_before
from llmd.clients.lsp_prompt import FimBudget, build_fim

SOURCE = '''def area(r):
    """Area of a circle."""
    pi = 3.14159
    half = r / 2
    return pi * r * r


def perimeter(r):
    return 2 * 3.14159 * r
'''


def test_the_removed_statement_is_not_in_the_prompt():
    cases = file_cases("geo.py", SOURCE)
    assert cases
    for case in cases:
        assert case.middle.strip() and case.middle not in case.document
        assert case.document[:case.start] + case.middle + case.document[case.start:] == SOURCE
        p = build_fim(case.document, case.start, (), FimBudget())
        assert p.prefix + p.suffix == case.document and case.middle not in p.suffix


def test_the_document_before_the_last_keystroke_or_line():
    start = SOURCE.index("half")
    case = Case("geo.py:4", SOURCE, start, SOURCE.index("    return"))
    doc, cursor = typed_before(case, "psm-shift")
    assert doc == case.document[:start - 1] + case.document[start:] and cursor == start - 1
    doc, cursor = typed_before(case, "psm-shift-line")
    above = SOURCE.index("    pi")
    assert doc == case.document[:above] + case.document[start:] and cursor == above
