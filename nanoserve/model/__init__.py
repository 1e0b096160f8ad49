"""The model: its configuration and families (`config`, `families`, `quantization`), the
decoder (`model`), attention (`attention`), mixture-of-experts layers (`moe`), what a
classification head's logits mean (`labels`)."""
