"""Where replies come from: the embedded engine, an OpenAI-compatible server, a ZeroGPU worker process; the protocol between a conversation and them."""
