"""The stand-in Hub fixture (defined in tests/hub_stand_in.py, shared with the desktop and CLI tests)."""
from tests.hub_stand_in import hub  # noqa: F401 - a fixture
