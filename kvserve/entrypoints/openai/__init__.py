"""The OpenAI-compatible server (`kvserve serve`): FastAPI app, protocol models, handlers."""
