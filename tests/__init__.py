"""The test suite, one folder per part of the proxy (README "Tests")."""
