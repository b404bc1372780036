"""The documents' results tables rendered from the result files, and running every benchmark."""
