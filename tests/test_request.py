"""The planning request: one typed object whose fields own their defaults and documentation, from
which the options of ``plan``, ``estimate`` and ``sweep`` are built, and whose types are checked in
the caller's name."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from planner.cli import app
from planner.options import Opt, Values, command
from planner.request import MESH_AXES, PriceRequest, Request, check_fields, doc, option
from vocab.errors import ShardplanError

runner = CliRunner()


def _command(name: str) -> Any:
    import planner.commands  # noqa: F401  (registers the commands)

    return next(c for c in app.registered_commands if c.name == name).callback


def test_the_request_defaults_are_the_owners_defaults() -> None:
    from solvers.mip import DEFAULT_SOLVER
    from solvers.space import SPACES
    from vocab.strategy import Mesh
    from vocab.targets import DEFAULT_TARGET

    r = Request("gpt2", "4xcpu", 128, 8)
    assert (r.target, r.solver) == (DEFAULT_TARGET, DEFAULT_SOLVER) and r.space in SPACES
    assert set(MESH_AXES) <= set(Mesh.model_fields)


def test_every_field_is_documented() -> None:
    for cls in (Request, PriceRequest):
        for f in dataclasses.fields(cls):
            assert doc(f.name, cls).strip(), f"{cls.__name__}.{f.name} has no documentation"


@pytest.mark.parametrize("name, cls", [("plan", Request), ("estimate", PriceRequest)])
def test_a_commands_options_of_request_fields_print_the_fields_documentation(name: str, cls: type) -> None:
    params = inspect.signature(_command(name)).parameters
    fields = {f.name for f in dataclasses.fields(cls)}
    shared = [p for p in params if p in fields and p != "reserve"]  # --reserve: a percent, the field a fraction
    assert len(shared) > 10
    for p in shared:
        assert params[p].default.help == doc(p, cls), p


def test_plan_options_are_the_request_fields_in_order() -> None:
    names = list(inspect.signature(_command("plan")).parameters)
    fields = [f.name for f in dataclasses.fields(Request) if f.metadata["flags"]]
    assert [n for n in names if n in fields] == fields
    assert set(names) - set(fields) == {"reserve", "output", "as_json"}


def test_the_estimate_keys_are_the_price_request_fields() -> None:
    from planner.commands.estimate import KEYS, line_request

    assert KEYS == tuple(f.name for f in dataclasses.fields(PriceRequest))
    assert line_request({"memory_limit_gib": 20}).memory_limit == 20
    assert line_request({"memory_limit": None, "memory_limit_gib": 20}).memory_limit is None
    with pytest.raises(ShardplanError, match=r"unknown key\(s\) \['bogus'\]"):
        line_request({"bogus": 1})


@pytest.mark.parametrize("values, message", [
    ({"top_k": 2.0}, "caller: top_k must be an integer, got float 2.0"),
    ({"degrees": {"tp": "4"}}, "caller: degrees must be a dict or None, got dict {'tp': '4'}"),
    ({"bogus": 1}, "caller: got an unexpected keyword argument 'bogus'"),
])
def test_field_types_are_checked_in_the_callers_name(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ShardplanError) as e:
        check_fields("caller", values)
    assert str(e.value) == message


def test_a_request_checks_its_fields_when_made() -> None:
    with pytest.raises(ShardplanError, match="^Request: cluster must be a string or a dict or a Cluster, got int 4$"):
        Request("gpt2", 4, 128, 8)


def test_an_option_takes_a_commands_own_default_and_help() -> None:
    o = option("seq_len")
    assert (o.name, o.type, o.option.default, o.option.help) == ("seq_len", int, ..., "tokens per sample")
    o = option("target", help="targets")
    assert (o.option.default, o.option.help, o.option.param_decls) == ("shardplan", "targets", ("--target",))
    assert option("tp", cls=PriceRequest).option.default == 1 and PriceRequest().tp is None


def test_a_command_of_a_table_reads_its_options_into_one_object() -> None:
    seen: list[Values] = []
    cli = typer.Typer()

    @cli.command()
    @command((Opt("count", int, typer.Option(1, "--count")), Opt("name", str, typer.Option(..., "--name"))))
    def run(o: Values) -> None:
        seen.append(o)

    r = runner.invoke(cli, ["--name", "x", "--count", "3"])
    assert r.exit_code == 0, r.output
    assert seen == [{"count": 3, "name": "x"}] and seen[0].count == 3
    with pytest.raises(AttributeError):
        _ = seen[0].missing


def test_the_api_plan_is_the_request_searched() -> None:
    from planner.api import plan, search_plan

    kw = {"space": "fsdp", "top_k": 1}
    searched = search_plan(Request("gpt2", "4xcpu", 128, 8, **kw)).plan
    assert plan("gpt2", "4xcpu", 128, 8, **kw).to_json() == searched.to_json()
