"""The OpenAI-compatible HTTP server (`inferd serve`): FastAPI app, schemas, errors, auth, metrics."""
