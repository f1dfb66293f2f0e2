"""token_proxy.admin (issue 21 layout; see ARCHITECTURE.md)."""
