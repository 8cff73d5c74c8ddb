"""Entry points: the offline LLM, the launcher and the CLI. They compose the services; the foundation
around them (stubs, sampling parameters, step messages, config) imports no service."""
