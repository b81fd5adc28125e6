"""Real-model matrix: transformers and peft models built from tiny configs."""
