"""token_proxy.api (issue 21 layout; see ARCHITECTURE.md)."""
