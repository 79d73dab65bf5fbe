//! OpenAI-compatible HTTP server (not built yet).
