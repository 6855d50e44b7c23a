"""The OpenAI-compatible HTTP API beside gRPC, on the same router (docs/router.md, HTTP API)."""
