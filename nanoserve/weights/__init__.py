"""The model's files: finding and fetching them (`model_store`), GGUF files (`gguf_file`),
loading the checkpoint's tensors into the model (`weights`, `moe_weights`, `fp8`, random
ones in `dummy_weights`), the tokenizer and its chat template (`tokenizer`,
`chat_template`)."""
