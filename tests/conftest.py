import pytest


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "fuzz_long: the long input-fuzzing profile (run with -m fuzz_long or SHARDPLAN_FUZZ_LONG=1)"
    )


def _console_width(width: int | None):  # type: ignore[no-untyped-def]
    """The CLI's console at ``width`` columns (None: sized by COLUMNS, as the CliRunner's ``env``
    sets it), whatever the width the test process started with; restored afterwards."""
    from planner.cli import console

    old = console._width
    console._width = width
    yield
    console._width = old


@pytest.fixture
def wide():  # type: ignore[no-untyped-def]
    """A wide terminal (200 columns) for the rich tables."""
    yield from _console_width(200)


@pytest.fixture
def columns_from_env():  # type: ignore[no-untyped-def]
    """The CLI's console sized by COLUMNS."""
    yield from _console_width(None)
