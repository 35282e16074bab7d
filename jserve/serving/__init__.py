"""Front ends over the engine: the offline LLM API, the async loop and the OpenAI-compatible server."""
