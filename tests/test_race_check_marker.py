"""The suite's switch for the emulated device's race check (tests/conftest.py): on for every test,
off for a test marked `no_race_check`, set before the test's fixtures so a model or device a
fixture builds follows its test; a value given in the environment holds for every test."""

from __future__ import annotations

import os

import pytest

from moelight.devices.registry import create_device
from tests.conftest import RACE_CHECK, RACE_CHECK_GIVEN

pytestmark = pytest.mark.skipif(RACE_CHECK_GIVEN, reason=f"{RACE_CHECK} given: that value holds for every test")


@pytest.fixture(scope="module")
def checked_in_fixture():
    """The environment a module fixture sees, built in the setup of the unmarked test that asks for it."""
    return os.environ.get(RACE_CHECK)


@pytest.fixture(scope="module")
def unchecked_in_fixture():
    """The same, built in the setup of the marked test."""
    return os.environ.get(RACE_CHECK)


def _device_checks() -> bool:
    dev = create_device("emulated", capacity_bytes=1 << 20)
    try:
        return dev.races is not None
    finally:
        dev.close()


def test_an_unmarked_test_runs_the_check_and_its_fixtures_too(checked_in_fixture):
    assert os.environ.get(RACE_CHECK) == "1" and checked_in_fixture == "1"
    assert _device_checks()


@pytest.mark.no_race_check
def test_a_marked_test_runs_without_it(unchecked_in_fixture):
    assert RACE_CHECK not in os.environ and unchecked_in_fixture is None
    assert not _device_checks()


def test_the_next_unmarked_test_has_it_again():
    assert os.environ.get(RACE_CHECK) == "1"
    assert _device_checks()
