"""POST /v1/completions: request, endpoint, format."""
