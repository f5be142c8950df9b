"""The gateway's ``rollout.args.host`` is checked when the recipe loads: an address the
server could not bind stops ``polyrl train`` with one message (exit 2), before any model
loads, instead of a socket error when the gateway starts."""

from __future__ import annotations

import pytest

from polyrl.core.runner.cli import main
from tests.helpers.gateway import HERE, gateway_recipe


@pytest.mark.parametrize(
    "host",
    [
        "not an address",  # a typo'd or pasted phrase
        "127.0.0.300",  # not an IPv4 address
        "192.0.2.1",  # an address, but of no interface here (TEST-NET-1, never assigned)
        "::1",  # the server listens on IPv4
    ],
)
def test_a_host_the_gateway_cannot_bind_fails_at_load(tmp_path, capsys, host):
    recipe = gateway_recipe(tmp_path, f"{HERE}:grid_agent")
    assert main(["train", recipe, f"rollout.args.host={host}"]) == 2
    err = capsys.readouterr().err
    assert f"rollout.args.host={host!r} cannot be bound" in err and "Traceback" not in err
    assert "127.0.0.1" in err  # what to give instead


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "localhost"])
def test_addresses_of_this_machine_load(tmp_path, host):
    from polyrl.core.config import load
    from polyrl.core.recipe import Config

    cfg = load(
        Config, gateway_recipe(tmp_path, f"{HERE}:grid_agent"), [f"rollout.args.host={host}"]
    )
    assert cfg.rollout.args.host == host
