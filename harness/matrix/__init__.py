"""The model support matrix: every text model type mlx-lm ships, served and checked (``make model-matrix``)."""
