"""All engine I/O: the EngineAdapter protocol and its vLLM / LMCache implementations."""
