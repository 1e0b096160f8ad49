"""Choosing tokens: the sampling settings (`params`), a step's sampling over a batch
(`step_sampling`), log-probabilities (`logprobs`), structured outputs (`structured`), label
scores (`choice_scores`), reasoning parsers (`reasoning`), and a row's tokens and output
(`sequence`)."""
