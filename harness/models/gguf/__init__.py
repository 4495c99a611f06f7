"""GGUF files to MLX model directories: weights (``convert``) and tokenizer (``tokenizer``)."""
