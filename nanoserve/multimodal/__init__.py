"""Images in prompts: reading them (`image_input`), the vision tower and its settings
(`vision_model`, `vision_config`), a prompt's placeholders and M-RoPE positions (`prompt`,
`mrope`). Below the model, which runs the vision tower."""
