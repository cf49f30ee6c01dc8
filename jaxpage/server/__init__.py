"""The OpenAI-compatible HTTP server: schemas, routes, errors and metrics."""
