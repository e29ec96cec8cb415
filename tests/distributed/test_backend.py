"""The decoding back-end interface: both implementations fill it in whole, with its signatures, so `Service`
can hold either without asking which (that they give the same tokens: tests/distributed/test_verifier.py)."""

from __future__ import annotations

import inspect

import pytest

from rasd.distributed.backend import DecodingBackend, LocalBackend


def implementations() -> list[type]:
    pytest.importorskip("ray")
    from rasd.distributed.verifier import RemoteBackend

    return [LocalBackend, RemoteBackend]


def interface() -> dict[str, object]:
    return {name: getattr(DecodingBackend, name) for name in sorted(DecodingBackend.__abstractmethods__)}


def test_the_interface_is_written_down() -> None:
    """Every method a service calls is declared, each with a docstring saying what it promises."""
    assert set(interface()) == {"name", "threads", "start", "events", "check_capacity", "load",
                                "health_problem", "add_segments", "stats", "close"}
    for name, member in interface().items():
        doc = (member.fget if isinstance(member, property) else member).__doc__
        assert doc and doc.strip(), name


@pytest.mark.parametrize("cls", implementations(), ids=lambda c: c.__name__)
def test_an_implementation_fills_in_every_method_with_its_signature(cls: type) -> None:
    assert issubclass(cls, DecodingBackend) and not inspect.isabstract(cls)
    for name, declared in interface().items():
        mine = inspect.getattr_static(cls, name)
        if isinstance(declared, property):
            assert isinstance(mine, property), f"{cls.__name__}.{name} is not a property"
            continue
        assert list(inspect.signature(mine).parameters) == list(inspect.signature(declared).parameters), name
        assert inspect.isasyncgenfunction(mine) == (name == "events"), name
