"""POST /inference/v1/generate (token in, token out): request, endpoint, format."""
