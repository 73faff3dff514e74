"""The tool API of the agents domain: calculator, key-value store, call format, executor, episodes."""

import time

from kimik3.posttrain.tasks import make_tasks
from kimik3.posttrain.tasks.agents import MAX_CALLS, calculate, execute, parse_calls, run_calls


def test_calculator_and_store():
    store = {"a": 6, "b": 7}
    assert execute("calc a * b + 1", store) == "43"
    assert execute("calc (a - 10) // 3", store) == "-2"
    assert execute("set c 42", store) == "ok" and store["c"] == 42
    assert execute("get c", store) == "42"
    assert execute("delete a", store) == "ok" and "a" not in store
    assert execute("  set   d -5 ", store) == "ok" and store["d"] == -5
    assert store == {"b": 7, "c": 42, "d": -5}


def test_bad_calls_are_errors_not_exceptions():
    store = {"a": 1}
    for call in ["calc a / 0", "calc a // 0", "calc 2 ** 10", "calc __import__('os')", "calc a.real", "calc nope",
                 "calc " + "(" * 5000 + "1" + ")" * 5000, "calc 10**40", "calc 9" * 50, "set a 1.5", "set A 1",
                 "set a", "get zz", "delete zz", "launch rockets", "", "calc", "calc 'x' * 3", "calc [1]"]:
        before = dict(store)
        result = execute(call, store)
        assert result.startswith("error:"), (call, result)
        assert store == before
    assert calculate("-(3 + 4) * 2 % 5", {}) == 1


def test_calls_are_parsed_in_order_and_capped():
    text = "<think>plan</think><call>set a 1</call> noise <call>calc a + 1</call><call>unclosed"
    assert parse_calls(text) == ["set a 1", "calc a + 1"]
    assert len(parse_calls("<call>set a 1</call>" * 1000)) == MAX_CALLS
    store, results = run_calls(text, {"x": 1})
    assert store == {"x": 1, "a": 1} and results == ["ok", "2"]
    start = time.monotonic()
    parse_calls("<call>" * 100_000)
    assert time.monotonic() - start < 2


def test_an_episode_replies_with_the_tool_results_until_a_turn_without_a_call():
    task = make_tasks("agents", "test", 1, seed=0, effort="high")[0]
    turns = [m["content"] for m in task.reference if m["role"] == "assistant"]
    results = [m["content"] for m in task.reference if m["role"] == "user"]
    for i in range(len(results)):   # the environment answers exactly as the reference records
        assert task.reply(turns[: i + 1]) == results[i]
    assert task.reply(turns) is None                       # "Done." ends the episode
    assert task.reply(["<call>launch</call>"]).startswith("<result>error:")
    assert task.reply(["<call>set x 1</call>"] * task.max_turns) is None   # the turn limit
    assert task.score(task.reference_completion()) == 1.0
    assert task.score("Done.") == 0.0
