"""Helpers shared by test modules (imported as tests.support.<name>); fixtures live in tests/conftest.py."""
