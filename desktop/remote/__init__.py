"""Remote engines and serving: an OpenAI-compatible server as the model source, its key, and serving the loaded model."""
