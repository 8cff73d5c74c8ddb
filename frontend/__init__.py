"""The public API: gRPC streaming Generate, tokenizer, incremental detokenizer, stop strings, validation."""
