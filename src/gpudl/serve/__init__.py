"""Serving trained models: load (safetensors or a run's checkpoint), the engine (dynamic batching,
KV-cached continuous batching; no HTTP), and the HTTP app. Nothing heavy is imported here: import
`gpudl.serve.load`, `gpudl.serve.engine` or `gpudl.serve.server` for what you need."""
