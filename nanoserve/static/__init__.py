"""The static engine: one batch prefilled together and decoded to its end (`generate`), its
decode step as a CUDA graph (`cuda_graph`). Its batch counters (`BatchStats`) and pool size
serve the continuous engine too."""
