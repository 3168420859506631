"""OpenAI-compatible HTTP server (`pagedllm serve`): api_server builds the app, serving_* the endpoints."""
