"""AWS prices against the test server (tests/aws_server.py): on-demand from the Price List API
(GetProducts, which the server emulates: moto has no `pricing` service), the table in
instance_types.json when that API fails or does not list the type, spot from the history."""
from __future__ import annotations

import pytest

from speedrun.cluster.aws.api import Session
from speedrun.cluster.aws.pricing import PRICES_AS_OF, listed_price, offer_price, table_price

pytestmark = [pytest.mark.netns, pytest.mark.aws]


def test_on_demand_prices_come_from_the_price_list_api(aws):
    aws.list_price("p4d.24xlarge", 21.9576)
    usd, source = listed_price(Session("us-east-1"), "p4d.24xlarge")
    assert usd == pytest.approx(21.9576) and source.startswith("AWS Price List API, ")
    assert "GetProducts" in aws.calls


def test_the_table_stands_in_only_when_the_api_fails_or_lists_nothing(aws):
    assert table_price("us-east-1", "p4d.24xlarge") == 21.96
    # Not listed there: the table's price, saying which table.
    assert listed_price(Session("us-east-1"), "p4d.24xlarge") == (21.96, f"on-demand table of {PRICES_AS_OF}")
    aws.list_price("p4d.24xlarge", 20.0)
    aws.fail("GetProducts", "ServiceUnavailable")  # the API does not answer
    assert listed_price(Session("us-east-1"), "p4d.24xlarge") == (21.96, f"on-demand table of {PRICES_AS_OF}")
    aws.garble("GetProducts")
    assert listed_price(Session("us-east-1"), "p4d.24xlarge")[0] == 21.96
    assert listed_price(Session("us-east-1"), "x9.unknown") is None  # in neither: no price, never a zero


def test_an_offer_is_priced_per_machine_on_demand_or_at_the_cheapest_zones_spot_price(aws):
    aws.list_price("c5.large", 0.085)
    on_demand = offer_price(Session("us-east-1"), "c5.large", spot=False)
    assert (on_demand.market, on_demand.machines, on_demand.usd_per_hour) == ("on-demand", 1, 0.085)
    spot = offer_price(Session("us-east-1"), "c5.large", spot=True)
    history = aws.client().describe_spot_price_history(InstanceTypes=["c5.large"],
                                                       ProductDescriptions=["Linux/UNIX"])["SpotPriceHistory"]
    assert spot.market == "spot" and spot.usd_per_hour == min(float(h["SpotPrice"]) for h in history)
    assert spot.source.startswith("spot price history, us-east-1")
