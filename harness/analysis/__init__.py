"""After a run: compare results documents (``compare``) and mlx-lm versions against each other (``versions``)."""
