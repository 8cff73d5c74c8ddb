"""The public API: gRPC streaming Generate, tokenizer, validation; text through pagedserve.output."""
