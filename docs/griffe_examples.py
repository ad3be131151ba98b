"""A griffe extension for the API reference: ``Example:`` sections are doctest examples.

The project's docstrings title their doctests ``Example:``; griffe's Google parser knows only
``Examples:`` as a code section and would render the doctest lines as Markdown text. This
rewrites the title before the docstring is parsed (nothing in the source changes).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_TITLE = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)


class DoctestExamples(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _TITLE.sub(r"\1Examples:", obj.docstring.value)
