"""The KV cache: the paged pool and its tensors (`pool`), the block tables over it
(`block_manager`), the prefix cache's hashes (`prefix_cache`), the KV cache's dtype
(`kv_cache_dtype`), one step's view of the pool (`step_cache`). Below the model, whose
attention reads and writes it."""
