"""The loss catalogue (docs/catalogue.md) against the one registry of terms (`losses.TERMS`).

The page is regenerated and compared; the registry must list every public term constructor,
quote each formula from its constructor's docstring, and agree with the term cases of
tests/cases.py about which terms are not exact under `split_batch`.
"""

from __future__ import annotations

import importlib.util
import inspect
import pathlib
import sys

import pytest

import losses
from tests import cases

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: Public constructors returning a `Term` that are not catalogue rows, with the reason.
NOT_CATALOGUED = {"policy_term": "the building block the policy family's constructors share"}


def _generator():
    spec = importlib.util.spec_from_file_location("gen_catalogue", ROOT / "docs/gen_catalogue.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _squash(text: str) -> str:
    return " ".join(text.split())


def test_catalogue_page_is_generated_from_the_registry():
    page = (ROOT / "docs/catalogue.md").read_text()
    assert page == _generator().render(), "docs/catalogue.md is stale: python docs/gen_catalogue.py"


def test_registry_lists_every_public_term_constructor():
    constructors = {
        name
        for name in losses.__all__
        if inspect.isfunction(getattr(losses, name))
        and inspect.signature(getattr(losses, name)).return_annotation in ("Term", losses.Term)
    }
    assert constructors - set(NOT_CATALOGUED) == set(losses._registry.BY_NAME)
    for info in losses.TERMS:
        assert getattr(losses, info.name) is info.constructor
        assert isinstance(info.build(), losses.Term)


@pytest.mark.parametrize("info", losses.TERMS, ids=lambda i: i.name)
def test_formula_is_quoted_from_the_docstring(info):
    doc = _squash(inspect.getdoc(info.constructor))
    assert _squash(info.formula) in doc, f"{info.name}: formula not in its docstring"


def test_terms_whose_cases_skip_split_batch_are_not_marked_exact():
    """tests/cases.py skips the split_batch property for the configurations where it cannot
    hold; the registry must not call those constructors unconditionally exact."""
    skipped = {
        c.term().kind
        for c in cases.CASES
        if any(name == "test_split_batch_reproduces_full_batch" for name, _ in c.skip)
    }
    assert skipped, "the case registry no longer marks any split_batch skip"
    for kind in skipped:
        assert losses._registry.BY_NAME[kind].microbatch_exact != "yes", kind


def test_registry_rejects_bad_entries():
    with pytest.raises(ValueError, match="family"):
        losses.TermInfo(losses.grpo, "nonsense", "ℓ", "x")
    with pytest.raises(ValueError, match="exact_note"):
        losses.TermInfo(losses.grpo, "policy", "ℓ", "x", microbatch_exact="no")
