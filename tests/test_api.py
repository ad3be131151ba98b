"""Public-API guards: imports without torch/SDK, docstrings with Args/Returns, doctests."""

import doctest
import importlib
import inspect
import subprocess
import sys

import pytest

import losses


def test_losses_imports_without_torch_fireworks_or_runner():
    code = (
        "import sys, losses\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'fireworks', 'runner')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_losses_source_never_imports_runner_torch_or_sdk():
    import pathlib

    root = pathlib.Path(losses.__file__).parent
    for path in root.glob("*.py"):
        text = path.read_text()
        for banned in ("import torch", "from torch", "import runner", "from runner", "fireworks"):
            assert banned not in text, f"{path.name} mentions {banned!r}"


@pytest.mark.parametrize("name", losses.__all__)
def test_public_functions_document_args_and_returns(name):
    obj = getattr(losses, name)
    if not callable(obj):
        return
    doc = inspect.getdoc(obj) or ""
    assert doc, f"{name} has no docstring"
    if inspect.isfunction(obj):
        params = [
            p
            for p in inspect.signature(obj).parameters.values()
            if p.kind is not p.VAR_POSITIONAL or True
        ]
        if params:
            assert "Args:" in doc, f"{name} docstring lacks Args:"
        assert "Returns:" in doc, f"{name} docstring lacks Returns:"


def test_docstring_examples_run():
    failures = 0
    for mod in ("_grpo", "_env", "_sft", "_fold", "_advantages"):
        module = importlib.import_module(f"losses.{mod}")
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        failures += result.failed
    assert failures == 0
