"""POST /v1/chat/completions and /v1/chat/completions/tokens: request, endpoint, format."""
