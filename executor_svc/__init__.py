"""The executor: model, KV tensors, attention backends and sampler."""
