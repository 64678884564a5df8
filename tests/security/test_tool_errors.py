"""A tool call that raises is an error text for the model, never an exception out of the rollout.

ToolSet.run is what the agent loop calls for every tool call of a turn; whatever the call's
arguments make a built-in or a user's tool do, each call gets a text answer.
"""

from __future__ import annotations

import textwrap

import pytest

from gpu_jobs.chat.tools import TOOLS, ToolSet

USER_TOOLS = textwrap.dedent(
    '''
    import threading

    def recurse(arguments):
        return recurse(arguments)

    class Sly:
        def __str__(self):
            raise ValueError("no text for you")

    def sly(arguments):
        return Sly()

    def unpicklable(arguments):
        raise type("Local", (Exception,), {})(threading.Lock())

    def fine(arguments):
        return arguments[::-1]
    '''
)


def test_a_deep_calculator_expression_is_an_error_text():
    tools = ToolSet(["calculator"])
    long_sum, nested = "1+" * 1000 + "1", "(" * 3000 + "1" + ")" * 3000
    answers = tools.run([("calculator", long_sum), ("calculator", {"expression": nested}), ("calculator", "2*3")])
    # Whether 1,000 terms reach Python's recursion limit depends on the process (a library may have
    # raised the limit): the right sum or the error text, never an exception.
    assert answers[0] in ("1001", "error: expression too long or too deeply nested"), answers[0]
    assert answers[1].startswith("error:") and answers[2] == "6"
    assert tools.run([("calculator", "1+" * 500 + "1")]) == ["501"]  # long but fine still answers


def test_a_builtin_that_raises_is_an_error_text(monkeypatch):
    def explode(arguments: str) -> str:
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setitem(TOOLS._items, "explode", explode)
    assert ToolSet(["explode"]).run([("explode", "x")]) == ["error: RecursionError: maximum recursion depth exceeded"]


@pytest.fixture
def user_tools(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(USER_TOOLS)
    return str(path)


def test_a_user_tool_that_raises_is_an_error_text(user_tools):
    names = ["recurse", "sly", "unpicklable", "fine"]
    tools = ToolSet([f"{user_tools}:{n}" for n in names], num_workers=1)
    recurse, sly, unpicklable, fine = tools.run([(n, "abc") for n in names])
    assert recurse.startswith("error: RecursionError")
    assert sly == "error: ValueError: no text for you"
    assert unpicklable.startswith("error: Local")
    assert fine == "cba"
