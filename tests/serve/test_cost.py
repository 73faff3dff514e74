import pytest

from kimik3.cli import main
from kimik3.serve.cost import request_cost, session_cost
from kimik3.serve.types import Usage


def test_request_cost_uses_k3_prices():
    assert request_cost(1_000_000, 0, 0) == pytest.approx(3.00)
    assert request_cost(1_000_000, 1_000_000, 0) == pytest.approx(0.30)
    assert request_cost(0, 0, 1_000_000) == pytest.approx(15.00)
    assert Usage(prompt_tokens=2000, completion_tokens=100, cached_tokens=1500).cost_usd == pytest.approx(
        (1500 * 0.30 + 500 * 3.00 + 100 * 15.00) / 1e6)
    with pytest.raises(ValueError, match="cached"):
        request_cost(10, 11, 0)


def test_the_maps_session_example():
    cost = session_cost(50, 400_000, 4_000)
    assert cost.uncached_usd == pytest.approx(60.60)
    assert cost.cached_usd == pytest.approx(6.60)
    grown = session_cost(3, 1000, 100, 10, growing=True)
    assert grown.prompt_tokens == 1100 + 1210 + 1320 and grown.cached_tokens == 1000 + 1110 + 1220


def test_kimik3_cost_prints_both_totals(capsys):
    assert main(["cost"]) == 0
    out = capsys.readouterr().out
    assert "$60.60" in out and "$6.60" in out
    assert main(["cost", "--turns", "0"]) == 2
