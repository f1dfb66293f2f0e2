"""token_proxy.ops (issue 21 layout; see ARCHITECTURE.md)."""
