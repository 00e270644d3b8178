"""pytest setup of the deploy/ checks: the agent binary they check flags
against. Each check prints what it found (`-rA` shows it)."""

import os

import pytest


def pytest_addoption(parser):
    parser.addoption("--bin", default=os.environ.get("DEVTRACE_BIN", "target/debug/devtrace"),
                     help="the devtrace binary the flags are checked against")


@pytest.fixture(scope="session")
def binary(request):
    path = request.config.getoption("--bin")
    if not os.access(path, os.X_OK):
        pytest.exit("agent binary %r not found or not executable (cargo build first)" % path,
                    returncode=1)
    return os.path.abspath(path)
