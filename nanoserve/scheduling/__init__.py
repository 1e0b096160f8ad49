"""The continuous engine: the scheduler (`scheduler`), the model runner and its steps
(`model_runner`, `fixed_prefill`, `step_graphs`), the running batch's default size
(`running_rows`), the loop other threads submit rows to (`engine_loop`)."""
