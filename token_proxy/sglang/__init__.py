"""token_proxy.sglang (issue 21 layout; see ARCHITECTURE.md)."""
