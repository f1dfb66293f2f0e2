"""POST /tokenize and /detokenize."""
